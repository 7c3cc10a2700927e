"""DeepSeek-V3.2: config, modules (MLA in its absorbed form with the lightning indexer, dense
and MoE feed-forwards, the MTP layer), checkpoint loading (HF's names and the release's, FP8
weights with their block scales) and the tiny random checkpoints. The family interface is in
engine.models."""

from __future__ import annotations

from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.weights import build_model, load_weights

__all__ = ["ModelConfig", "build_model", "load_weights"]
