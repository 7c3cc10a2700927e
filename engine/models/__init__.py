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

Families are imported on first use, so this module (and `read_config`) stays torch-free.
DeepSeek-V3.2 (`deepseek_v32`) comes next.
"""

from __future__ import annotations

import importlib
import json
import os
from types import ModuleType
from typing import Any

FAMILIES = {"deepseek_v4": "engine.models.deepseek_v4"}


class ConfigError(ValueError):
    """The checkpoint's config.json describes a model this engine cannot serve."""


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The raw config.json of a checkpoint directory, or a ConfigError saying what is wrong."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: a model directory needs an HF config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def family(model_dir: str | os.PathLike) -> ModuleType:
    """The package that serves the checkpoint in `model_dir`."""
    model_type = read_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json field `model_type`: {model_type!r} is not served here; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type])
