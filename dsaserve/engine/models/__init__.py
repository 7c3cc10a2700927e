"""Model families, found by the checkpoint's HF `model_type` (like vLLM's model registry).

Each family is a package that exposes the same names, so the runtime never imports a model by
name:

    ModelConfig.from_dir(dir)          the checkpoint's config.json, parsed and validated; it
                                       describes the KV state to the pools (engine.kv.layout's
                                       KVModel: layer groups, compressor rings, row widths)
    build_model(cfg, dtype, device, quantized, tp)
                                       the module in its run-time dtypes, weights not yet loaded
                                       (quantized: keep an FP8/FP4 checkpoint's formats); what
                                       the runner calls (engine.runner.Model)
    load_weights(model, dir)           fill it from the checkpoint's safetensors

Families are imported on first use, so this module stays torch-free.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from dsaserve.engine.model_dir import ConfigError, read_config

FAMILIES = {
    "deepseek_v4": "dsaserve.engine.models.deepseek_v4",
    "deepseek_v32": "dsaserve.engine.models.deepseek_v32",
}


def family(model_dir: str | os.PathLike) -> ModuleType:
    """The package that serves the checkpoint in `model_dir`."""
    model_type = read_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json field `model_type`: {model_type!r} is not served here; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type])
