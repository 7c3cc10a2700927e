"""`dsaserve make-tiny-model DIR`: write a tiny random DeepSeek-V4 checkpoint (every layer kind)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import setting


@dataclass(frozen=True)
class MakeTinyModelSettings:
    """Tiny checkpoint"""

    dir: str = setting(dataclasses.MISSING, "output directory", positional=True)
    seed: int = setting(0, "seed of the random weights")


Settings = MakeTinyModelSettings


def run(s: MakeTinyModelSettings) -> None:
    from engine.models.deepseek_v4.tiny import make_tiny_model

    print(make_tiny_model(s.dir, seed=s.seed))
