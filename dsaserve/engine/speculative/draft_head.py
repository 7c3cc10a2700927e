"""Which checkpoints can draft: the checks that give a clear error at start, and the config whose
pools hold the MTP layer's KV state.

A family drafts when its config has `draft_layers` (DeepSeek-V4: its MTP layer's attention keeps
state in the pools like a layer's) and its model a `draft` method (engine.runner.DraftModel). A
checkpoint without MTP tensors, or a family whose draft head is not run here, is refused before
any weight is read where possible, never served with drafts that are silently never accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.speculative.config import SpeculativeConfig

C = TypeVar("C")


def draft_config(cfg: C, spec: SpeculativeConfig) -> C:
    """`cfg` with its first MTP layer in the pools (ConfigError when it cannot draft)."""
    family = getattr(cfg, "family", "?")
    if not hasattr(cfg, "draft_layers"):
        raise ConfigError(
            f"--speculative-config method {spec.method!r}: the {family} family's draft head is "
            "not run here (speculative decoding serves DeepSeek-V4's MTP layer)"
        )
    if not getattr(cfg, "mtp_layer_types", ()):
        raise ConfigError(
            f"--speculative-config method {spec.method!r} needs the checkpoint's MTP layer, "
            "and config.json declares none (num_nextn_predict_layers is 0)"
        )
    return dataclasses.replace(cfg, draft_layers=1)  # type: ignore[type-var]


def check_loaded(model: Any, model_dir: str) -> None:
    """After loading: the MTP layer's tensors were in the checkpoint (the loader drops the MTP
    layers of a checkpoint that stores none of their tensors)."""
    if not len(getattr(model, "mtp", ())):
        raise ConfigError(
            f"--speculative-config method 'mtp': the checkpoint in {model_dir} stores no MTP "
            "tensors (mtp.0.*; HF transformers' save_pretrained drops them), so there is "
            "nothing to draft with"
        )
