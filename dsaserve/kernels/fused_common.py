"""Pieces shared by the fused decode-glue kernels (kernels.fused_*).

The fused kernels hold a row of D channels as two halves, the even channels x0 and the odd
channels x1 ([..., D // 2] each): DeepSeek-V4's RoPE rotates interleaved pairs (x0, x1), and an
RMS norm needs only the sum of squares of both halves, so no kernel has to shuffle channels
between threads.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rotate(x0, x1, c, s):
    """Rotate channel pairs (x0, x1) by the angle whose cosine and sine are (c, s), in fp32, in
    the op order of kernels.reference.apply_rope."""
    return x0 * c - x1 * s, x1 * c + x0 * s


@triton.jit
def cos_sin(angle, PRECISE: tl.constexpr):
    """cos and sin of fp32 angles. PRECISE (compiled kernels): libdevice, the CUDA math library
    torch's cos/sin use, so RoPE tables built in a kernel match RotaryTable's bit for bit; tl.cos
    would lower to cos.approx, which is far off at angles of 1e5 rad. The interpreter has no
    libdevice: numpy's cos/sin there."""
    if PRECISE:
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:
        c, s = tl.cos(angle), tl.sin(angle)
    return c, s


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE and back to fp32: where the engine's torch ops store an intermediate
    in the model dtype, the fused kernels round there too (a no-op for fp32 models)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rope_in_place(x_ptr, r, live, tok, cos_ptr, sin_ptr, sign, D, HALF, BLOCK_H: tl.constexpr):
    """Rotate the trailing 2*HALF channels of rows r [R] (int64; row length D, contiguous) of x
    in place, row r by the angles of table row tok [R] (cos/sin [rows, HALF], sign -1 for the
    inverse rotation); only rows where live [R] holds. Touches 2*HALF of every D channels."""
    k = tl.arange(0, BLOCK_H)
    m = live[:, None] & (k < HALF)[None, :]
    at = x_ptr + r[:, None] * D + (D - 2 * HALF) + 2 * k[None, :]
    x0 = tl.load(at, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(at + 1, mask=m, other=0.0).to(tl.float32)
    table = tok[:, None] * HALF + k[None, :]
    c = tl.load(cos_ptr + table, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=m, other=0.0).to(tl.float32) * sign
    y0, y1 = rotate(x0, x1, c, s)
    tl.store(at, y0.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(at + 1, y1.to(x_ptr.dtype.element_ty), mask=m)


def halves(dim: int) -> int:
    """Block width of one half (even or odd channels) of a dim-wide row."""
    return triton.next_power_of_2(max(dim // 2, 1))
