"""A checkpoint directory's config.json, read without torch: what the model registry
(engine.models) and the chat format (engine.text.chat_format) both look at first."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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


def require(cond: bool, field: str, message: str) -> None:
    """Raise ConfigError naming config.json `field` unless `cond`."""
    if not cond:
        raise ConfigError(f"config.json field `{field}`: {message}")


def get_field(
    raw: dict[str, Any],
    field: str,
    default: Any = None,
    kind: type | tuple[type, ...] | None = None,
) -> Any:
    """raw[field], or `default` (required when the default is None), of type `kind` if given
    (bool is never taken for an int)."""
    value = raw.get(field, default)
    if value is None and default is None:
        raise ConfigError(f"config.json field `{field}` is required")
    if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ConfigError(
            f"config.json field `{field}` must be {getattr(kind, '__name__', kind)}, got {value!r}"
        )
    return value


FP8_BLOCK = 128  # the DeepSeek releases' FP8 weight block (128 x 128) and activation group


def check_fp8_quantization(qc: Any) -> None:
    """Raise ConfigError unless `quantization_config` is the one FP8 format the kernels implement,
    the DeepSeek releases': e4m3 weights with ue8m0 (power-of-two) 128 x 128 block scales and
    dynamic activation scales. Fields a checkpoint leaves out take the release's values."""
    require(isinstance(qc, dict), "quantization_config", "must be an object")
    release = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, want in release.items():
        got = qc.get(key, want)
        require(got == want, f"quantization_config.{key}", f"must be {want!r}, got {got!r}")
    # Scales of any fp32 value (DeepSeek-V3's format) are not read: the kernels take ue8m0.
    require(
        qc.get("scale_fmt") == "ue8m0",
        "quantization_config.scale_fmt",
        f"must be 'ue8m0' (power-of-two scales), got {qc.get('scale_fmt')!r}",
    )
    block = qc.get("weight_block_size")
    require(
        block is not None and list(block) == [FP8_BLOCK, FP8_BLOCK],
        "quantization_config.weight_block_size",
        f"must be [{FP8_BLOCK}, {FP8_BLOCK}], got {block!r}",
    )


def check_split(
    size: int, counts: Sequence[tuple[str, int]], fp8_blocks: Sequence[tuple[str, int]] = ()
) -> None:
    """Raise ConfigError unless `size` tensor-parallel ranks split every (name, count) of
    `counts` evenly and, where the split holds, every (name, per-rank count) of `fp8_blocks`
    (dims of FP8 weights kept quantized) falls on the FP8 block grid."""
    problems = [f"{what} ({n}) is not divisible by {size}" for what, n in counts if n % size]
    if not problems:
        problems = [
            f"{what} ({n} per rank) is not a multiple of the FP8 block ({FP8_BLOCK}), so ranks "
            "would share a block scale"
            for what, n in fp8_blocks
            if n % FP8_BLOCK
        ]
    if problems:
        raise ConfigError(
            f"tensor-parallel size {size} cannot split this model: {'; '.join(problems)}"
        )
