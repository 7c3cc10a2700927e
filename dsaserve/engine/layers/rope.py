"""RoPE tables: interleaved partial RoPE on the trailing `rope_dim` channels, optional YaRN.

The rotation itself is `kernels.apply_rope`.

DeepSeek-V4 rotates consecutive channel pairs (x0, x1) of the last `rope_dim` dims of each
head; the leading "nope" channels are untouched. Sliding-only layers use the plain "main"
table; CSA/HCA layers, their compressors and the indexer use the YaRN "compress" table.
DeepSeek-V3.2 has one YaRN table, whose cos/sin may carry YaRN's attention factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: plain (`factor` None) or YaRN-interpolated frequencies."""

    theta: float
    factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # cos and sin are scaled by it (YaRN's mscale ratio)


def inverse_frequencies(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    """[rope_dim // 2] fp32 inverse frequencies, YaRN-interpolated when `spec.factor` is set."""
    wavelengths = spec.theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if spec.factor is None:
        return 1.0 / wavelengths
    low, high = _yarn_correction_range(spec, rope_dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Pairs below the ramp keep their frequency; pairs above it are interpolated by `factor`.
    # (Written as HF writes it, so the fp32 table is bit-identical to the reference.)
    keep = 1 - ramp
    return 1.0 / (spec.factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def _yarn_correction_range(spec: RopeSpec, dim: int) -> tuple[float, float]:
    assert spec.original_max_position is not None
    original = spec.original_max_position

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    return max(math.floor(correction_dim(spec.beta_fast)), 0), min(
        math.ceil(correction_dim(spec.beta_slow)), dim - 1
    )


class RotaryTable(torch.nn.Module):
    """cos/sin for arbitrary positions of one RoPE spec."""

    inv_freq: torch.Tensor  # [rope_dim // 2] (a buffer)

    def __init__(self, spec: RopeSpec, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim, self.attention_factor = rope_dim, spec.attention_factor
        self.register_buffer("inv_freq", inverse_frequencies(spec, rope_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, sin), each [N, rope_dim // 2] in `dtype` (rounded as the
        reference rounds them)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # in fp32 before the rounding, as HF scales them
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
