"""DeepSeek-V4: config, modules (mHC, attention with compressors and the lightning indexer, MoE,
the MTP layer), checkpoint loading (the release's FP8/FP4 formats included) and the tiny random
checkpoints. The family interface is in engine.models.

The names are resolved on first use: the runtime's KV pool reads this family's config module,
which must not pull in the modules (they import the runtime's step state in turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.models.deepseek_v4.config import ModelConfig
    from engine.models.deepseek_v4.weights import build_model, load_weights

__all__ = ["ModelConfig", "build_model", "load_weights"]


def __getattr__(name: str) -> Any:
    if name == "ModelConfig":
        from engine.models.deepseek_v4.config import ModelConfig

        return ModelConfig
    if name in ("build_model", "load_weights"):
        from engine.models.deepseek_v4 import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
