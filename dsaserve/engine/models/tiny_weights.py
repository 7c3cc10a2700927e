"""What every family's tiny random checkpoint writer shares: deterministic random values that
keep activations O(1) and greedy choices decided by real margins, per-expert tensors as
checkpoints store them, and the release-style split into two shards behind an index."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsaserve.kernels.quant import quantize_fp8_blocks

PAD_HEAD_GAIN = 4.0  # padded rows of a head: their logits dwarf the real ones


def random_value(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor for parameter `name` of t's shape: norm weights and scales near 1,
    other vectors (biases, sinks) N(0, 0.5^2), the embedding N(0, 1), matrices N(0, 1/fan_in)."""
    if name.endswith(("norm.weight", ".scale")):
        return 1 + 0.1 * torch.randn(t.shape, generator=gen)
    if t.dim() == 1:
        return 0.5 * torch.randn(t.shape, generator=gen)
    fan_in = t.shape[-1]
    return torch.randn(t.shape, generator=gen) * (1.0 if name == "embed.weight" else fan_in**-0.5)


def split_experts(tensors: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Stacked expert weights (`<prefix>.w13` [E, gate | up, H], `<prefix>.w2`) -> per-expert
    `<prefix>.E.w{1,2,3}.weight`, as checkpoints store them; the rest unchanged."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.w13"):
            prefix = name.removesuffix(".w13")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.w3.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".experts.w2"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('.w2')}.{e}.w2.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def quantize_fp8(weight: torch.Tensor, scale_as_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 e4m3 weight and its 128 x 128 block scales (kernels.quant.quantize_fp8_blocks):
    ue8m0 (the DeepSeek-V4 release), or the same powers of two as fp32 (DeepSeek-V3.2's
    `weight_scale_inv`)."""
    codes, scale = quantize_fp8_blocks(weight)
    return codes, scale.float() if scale_as_fp32 else scale


def save_shards(
    tensors: dict[str, torch.Tensor], out: Path, in_first: Callable[[str], bool]
) -> None:
    """Two shards as the releases split them (whole layers per file, `in_first` says which
    names go to the first) and their model.safetensors.index.json."""
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {name: files[0 if in_first(name) else 1] for name in sorted(tensors)}
    for file in files:
        part = {k: v for k, v in tensors.items() if weight_map[k] == file}
        save_file(part, out / file, metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def first_half_of_layers(
    num_layers: int, layer: re.Pattern[str], embed: str
) -> Callable[[str], bool]:
    """`in_first` for save_shards: the embedding (names starting with `embed`) and the layers
    below num_layers // 2 (`layer`'s first group is a name's layer index)."""

    def in_first(name: str) -> bool:
        m = layer.match(name)
        return name.startswith(embed) or bool(m and int(m.group(1)) < num_layers // 2)

    return in_first
