"""DeepSeek-V4.1: config (text_config nested, CSA2's sources), modules (Engram with its tables in
host memory behind a device cache, attention over a window and shared compressed entries, the
two-level indexer, mHC with the previous sublayer's collapse weights, V4's MoE), bounded decoder
replay in prefill, checkpoint loading (32 x 32 FP8 blocks, FP4 experts) and the tiny random
checkpoints. The family interface is in engine.models."""

from __future__ import annotations

from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.models.deepseek_v41.weights import build_model, load_weights

__all__ = ["ModelConfig", "build_model", "load_weights"]
