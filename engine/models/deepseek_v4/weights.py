"""Load DeepSeek-V4 safetensors checkpoints (single file or sharded index), memory-mapped.

Accepted names: what HF transformers' `DeepseekV4ForCausalLM.save_pretrained` writes
(`model.layers.N.attn.wq_a.weight`, `model.embed_tokens.weight`, `head.weight`, per-expert
`ffn.experts.E.w1.weight`, ...) and DeepSeek's own release names (the same without the
`model.` prefix, `embed.weight`, `hc_head_fn`). Multi-token-prediction tensors (`mtp.*`)
are skipped. Anything else missing, unexpected or mis-shaped is reported in one error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.model import DeepseekV4

_RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^lm_head\."), "head."),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
    (re.compile(r"\.attn\.wo_a\.weight$"), ".attn.wo_a"),
]
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_SKIP = re.compile(r"^(model\.)?mtp\.")


class WeightsError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter / buffer name
    index: tuple = ()  # sub-slice of it that this checkpoint tensor fills
    source: str = ""  # the checkpoint name it comes from, as missing-tensor errors show it


def canonical_target(name: str, inter: int) -> _Target:
    """Map a checkpoint tensor name onto (our parameter, slice)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    m = _EXPERT.match(name)
    if m:
        prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
        if w == "w2":
            return _Target(f"{prefix}.w2", (e,), name)
        rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)  # w13 = [gate | up]
        return _Target(f"{prefix}.w13", (e, rows), name)
    return _Target(name, (), name)


def _expected_sources(param: str, num_experts: int) -> list[str]:
    """The checkpoint names (release naming) that together fill `param`."""
    if param.endswith(".experts.w13"):
        prefix = param.removesuffix(".w13")
        return [f"{prefix}.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3")]
    if param.endswith(".experts.w2"):
        prefix = param.removesuffix(".w2")
        return [f"{prefix}.{e}.w2.weight" for e in range(num_experts)]
    return [param]


def checkpoint_files(model_dir: str | os.PathLike) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> DeepseekV4:
    """Allocate the model directly in its run-time dtypes on `device` (weights zero until loaded).

    Modules create their fp32 parameters (norms, sinks, mHC, gate biases, compressor slot
    biases) explicitly; everything else takes `dtype`.
    """
    with torch.device(device), _default_dtype(dtype):
        model = DeepseekV4(cfg)
    return model.requires_grad_(False).eval()


def load_weights(model: DeepseekV4, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, or raise WeightsError."""
    cfg = model.cfg
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    state = {k: v for k, v in state.items() if not k.startswith("rope_tables.")}
    filled: set[str] = set()  # checkpoint names (release naming) copied into the model
    unexpected, misshaped = [], []
    files = checkpoint_files(model_dir)
    total = sum(os.path.getsize(f) for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < 2**30
    ) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if _SKIP.match(key):
                        continue
                    target = canonical_target(key, cfg.moe_intermediate_size)
                    dest = state.get(target.param)
                    if dest is None:
                        unexpected.append(key)
                        continue
                    dest = dest[target.index] if target.index else dest
                    src = f.get_slice(key)
                    shape = tuple(src.get_shape())
                    if shape != tuple(dest.shape):
                        misshaped.append(
                            f"{key}: checkpoint {list(shape)}, model expects {list(dest.shape)}"
                        )
                        filled.add(target.source)  # present, just wrong: reported once, above
                        continue
                    tensor = f.get_tensor(key)
                    with torch.no_grad():
                        dest.copy_(tensor)
                    filled.add(target.source)
                    bar.update(tensor.numel() * tensor.element_size())
    if cfg.tie_word_embeddings and "head.weight" not in filled and "embed.weight" in filled:
        with torch.no_grad():
            model.head.weight.copy_(model.embed.weight)
        filled.add("head.weight")
    missing = [s for k in state for s in _expected_sources(k, cfg.num_experts) if s not in filled]
    if missing or unexpected or misshaped:
        raise WeightsError(_report(model_dir, missing, unexpected, misshaped))


def _report(
    model_dir: str | os.PathLike, missing: list[str], unexpected: list[str], misshaped: list[str]
) -> str:
    lines = [f"checkpoint in {model_dir} does not match its config.json:"]
    for title, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("wrong shape", misshaped),
    ):
        if items:
            shown = ", ".join(items[:12]) + (
                f", ... ({len(items) - 12} more)" if len(items) > 12 else ""
            )
            lines.append(f"  {title} ({len(items)}): {shown}")
    return "\n".join(lines)
