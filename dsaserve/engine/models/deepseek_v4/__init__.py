"""DeepSeek-V4: config, modules (mHC, attention with compressors and the lightning indexer, MoE,
the MTP layer), checkpoint loading (the release's FP8/FP4 formats included) and the tiny random
checkpoints. The family interface is in engine.models."""

from __future__ import annotations

from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.weights import build_model, load_weights

__all__ = ["ModelConfig", "build_model", "load_weights"]
