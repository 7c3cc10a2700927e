"""A checkpoint directory's config.json, read without torch: what the model registry
(engine.models) and the chat format (engine.text.chat_format) both look at first."""

from __future__ import annotations

import json
import os
from typing import Any


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


def model_identity(model_dir: str | os.PathLike) -> str:
    """What tells this checkpoint's weights from another's without reading them: its config and
    the names and sizes of its weight files (the prefix cache salts its hashes with it)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    sizes = [(f, os.path.getsize(os.path.join(model_dir, f))) for f in files]
    return json.dumps([read_config(model_dir), sizes], sort_keys=True)
