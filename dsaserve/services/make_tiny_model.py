"""`dsaserve make-tiny-model DIR`: write a tiny random checkpoint of a served family (every layer
kind of DeepSeek-V4 by default; `--model-type deepseek_v32` for DeepSeek-V3.2, `deepseek_v41` for
DeepSeek-V4.1; `--draft dspark`: a V4 with a DSpark head)."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from dsaserve.engine.config import setting
from dsaserve.engine.models import FAMILIES

FORMATS = ("dense", "release")  # each family's tiny.FORMATS, without importing torch


@dataclass(frozen=True)
class MakeTinyModelSettings:
    """Tiny checkpoint"""

    dir: str = setting(dataclasses.MISSING, "output directory", positional=True)
    model_type: str = setting(
        "deepseek_v4",
        "the family (HF model_type) of the checkpoint",
        choices=tuple(sorted(FAMILIES)),
    )
    seed: int = setting(0, "seed of the random weights")
    format: str = setting(
        "dense",
        "dense: fp32 weights in one file; release: the family's published layout (V4: FP8 "
        "linears, FP4 experts, ue8m0 scales, an MTP layer; V3.2: FP8 weights with fp32 "
        "weight_scale_inv, an MTP layer; V4.1: text_config nested, 32x32 FP8 blocks, FP4 "
        "experts, FP8 Engram tables, the parts not served), sharded, a padded vocabulary",
        choices=FORMATS,
    )
    draft: str = setting(
        "mtp",
        "the draft head (V4): mtp, the format's own (an MTP layer in the release format, none "
        "in dense); dspark: a DSpark head in the release's layout (V4-Flash-0731's), for "
        '--speculative-config \'{"method": "dspark"}\'',
        choices=("mtp", "dspark"),
    )


Settings = MakeTinyModelSettings


def run(s: MakeTinyModelSettings) -> None:
    tiny = importlib.import_module(f"{FAMILIES[s.model_type]}.tiny")
    if s.draft != "mtp" and s.model_type != "deepseek_v4":
        raise SystemExit(f"--draft {s.draft}: only deepseek_v4 tiny checkpoints carry one")
    extra = {"draft": s.draft} if s.draft != "mtp" else {}
    print(tiny.make_tiny_model(s.dir, seed=s.seed, fmt=s.format, **extra))
