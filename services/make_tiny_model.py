"""`dsaserve make-tiny-model DIR`: write a tiny random DeepSeek-V4 checkpoint (every layer kind)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import setting

FORMATS = ("dense", "release")  # engine.models.deepseek_v4.tiny.FORMATS, without importing torch


@dataclass(frozen=True)
class MakeTinyModelSettings:
    """Tiny checkpoint"""

    dir: str = setting(dataclasses.MISSING, "output directory", positional=True)
    seed: int = setting(0, "seed of the random weights")
    format: str = setting(
        "dense",
        "dense: fp32 weights in one file; release: the DeepSeek-V4 release's layout (FP8 "
        "linears, FP4 experts, ue8m0 scales, sharded, an MTP layer, a padded vocabulary)",
        choices=FORMATS,
    )


Settings = MakeTinyModelSettings


def run(s: MakeTinyModelSettings) -> None:
    from engine.models.deepseek_v4.tiny import make_tiny_model

    print(make_tiny_model(s.dir, seed=s.seed, fmt=s.format))
