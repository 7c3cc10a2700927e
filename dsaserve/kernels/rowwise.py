"""Row-wise elementwise kernels of the model: RMS norm and interleaved partial RoPE.

A decode step calls each of them dozens of times on small rows; written in plain torch, one
call is 7-12 launches (upcast, square, mean, rsqrt, slice, stack, cat, cast ...), which made
elementwise work most of a decode step. Here each call is one launch. The plain-torch forms
in kernels.reference are the CPU path and follow HF transformers' op order exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):  # pass 1: sum of squares
        d = start + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK_D):  # pass 2: scale (and weight)
        d = start + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        y = x * inv
        if HAS_WEIGHT:
            y = tl.load(w_ptr + d, mask=d < D, other=0.0) * y
        tl.store(out_ptr + row * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] -> x / rms(x) (times an fp32 weight [D]), statistics in fp32, x's dtype out."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight if weight is not None else x2,
            out, D, eps,
            HAS_WEIGHT=weight is not None, BLOCK_D=min(4096, triton.next_power_of_2(D)),
            num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    rows, heads, D, HALF, sign,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    live = (r < rows)[:, None] & (d < D)[None, :]
    j = d - (D - 2 * HALF)  # position inside the rope slice (< 0: nope dims)
    rope = (j >= 0)[None, :] & live
    x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=live, other=0.0)
    partner = d + 1 - 2 * (j % 2)  # the other channel of the pair
    xp = tl.load(x_ptr + r[:, None] * D + partner[None, :], mask=rope, other=0.0).to(tl.float32)
    tok = (r // heads)[:, None]
    pair = (j // 2)[None, :]
    c = tl.load(cos_ptr + tok * HALF + pair, mask=rope, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * HALF + pair, mask=rope, other=0.0).to(tl.float32) * sign
    # even channel: x0*c - x1*s; odd channel: x1*c + x0*s
    rotated = x.to(tl.float32) * c + tl.where((j % 2 == 0)[None, :], -xp, xp) * s
    tl.store(
        out_ptr + r[:, None] * D + d[None, :], tl.where(rope, rotated.to(x.dtype), x), mask=live
    )


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing 2*half channels of x [N, ..., D] by cos/sin [N, half] (x's dtype);
    `inverse` rotates by minus the angle."""
    n, D, half = x.shape[0], x.shape[-1], cos.shape[-1]
    heads = x[0].numel() // D if n else 1
    x2 = x.reshape(-1, D)
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    out = torch.empty_like(x2)
    block_r = max(1, 2048 // triton.next_power_of_2(D))
    if x2.shape[0]:
        _rope_kernel[(triton.cdiv(x2.shape[0], block_r),)](
            x2, cos.contiguous(), sin.contiguous(), out, x2.shape[0], heads, D, half,
            -1.0 if inverse else 1.0,
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D),
            num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)
