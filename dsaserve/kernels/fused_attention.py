"""Attention's glue around its projections and its sparse-MLA kernel, fused.

attention_pre, one launch instead of seven (unweighted RMS norm of q per head, RoPE of q,
RMSNorm of kv, RoPE of kv, the scratch write, and for decode rows the ring write that the engine
does after attention as a gather + scatter): programs [0, q_programs) each take BLOCK_R query
head rows, the others BLOCK_R key/value rows; a row is normalised in fp32, rounded to the model
dtype (where the engine's norm kernel stores it), rotated on its trailing rope channels and
stored (kv rows also into the pool's scratch and ring slots).

attention_post rotates only the rope channels of the attention output back, in place, instead
of rewriting the whole [N, H, D] output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.fused_common import halves, rope_in_place, rotate, round_to

ROWS_PER_PROGRAM = 8  # x 512 channels: a 4K-element tile per program at V4-Flash's head_dim


@triton.jit
def _norm_rope(
    x_ptr,
    r, live, tok,
    w_ptr, cos_ptr, sin_ptr,
    eps,
    HAS_WEIGHT: tl.constexpr,
    D, HALF,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Rows r [R] (int64) of x [rows, D] -> RoPE(RMSNorm(x)) as (even, odd) channel halves
    [R, BLOCK_P] fp32 holding model-dtype values; cos/sin row tok [R]."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    p = tl.arange(0, BLOCK_P)
    m = live[:, None] & (p < D // 2)[None, :]
    at = x_ptr + r[:, None] * D + 2 * p[None, :]
    x0 = tl.load(at, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(at + 1, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1)) / D + eps)[:, None]
    y0, y1 = x0 * inv, x1 * inv
    if HAS_WEIGHT:
        y0 = tl.load(w_ptr + 2 * p, mask=p < D // 2, other=0.0)[None, :] * y0
        y1 = tl.load(w_ptr + 2 * p + 1, mask=p < D // 2, other=0.0)[None, :] * y1
    y0, y1 = round_to(y0, DTYPE), round_to(y1, DTYPE)
    k = p - (D // 2 - HALF)  # rope pair index; < 0 for the nope channels
    rope = (k >= 0)[None, :] & m
    table = tok[:, None] * HALF + k[None, :]
    c = tl.load(cos_ptr + table, mask=rope, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=rope, other=0.0).to(tl.float32)
    r0, r1 = rotate(y0, y1, c, s)
    return tl.where(rope, r0, y0), tl.where(rope, r1, y1), m


@triton.jit
def _store_rows(ptr, r, y0, y1, m, D, BLOCK_P: tl.constexpr):
    """Store (even, odd) halves [R, BLOCK_P] as rows r [R] (int64) of ptr [rows, D]."""
    at = ptr + r[:, None] * D + 2 * tl.arange(0, BLOCK_P)[None, :]
    tl.store(at, y0.to(ptr.dtype.element_ty), mask=m)
    tl.store(at + 1, y1.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _attention_pre_kernel(
    q_ptr,  # [N * H, D] wq_b output
    kv_ptr,  # [N, D] wkv output
    w_ptr,  # [D] fp32 kv norm weight
    cos_ptr,  # [N, HALF]
    sin_ptr,  # [N, HALF]
    q_out_ptr,  # [N * H, D]
    kv_out_ptr,  # [N, D]
    cache_ptr,  # [slots, D]
    scratch_ptr,  # [N] int64 scratch slots
    ring_ptr,  # [M] int64 ring slots of rows 0..M-1
    rows, heads, ring_rows, q_programs, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    WRITE_CACHE: tl.constexpr,  # False: an FP8 pool, written by the dispatcher
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < q_programs:  # query head rows; head row r belongs to token r // heads
        r = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        y0, y1, m = _norm_rope(
            q_ptr,
            r,
            r < rows * heads,
            r // heads,
            w_ptr,
            cos_ptr,
            sin_ptr,
            eps,
            False,
            D,
            HALF,
            BLOCK_P,
        )
        _store_rows(q_out_ptr, r, y0, y1, m, D, BLOCK_P)
    else:  # key/value rows
        r = ((pid - q_programs) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        live = r < rows
        y0, y1, m = _norm_rope(
            kv_ptr, r, live, r, w_ptr, cos_ptr, sin_ptr, eps, True, D, HALF, BLOCK_P
        )
        _store_rows(kv_out_ptr, r, y0, y1, m, D, BLOCK_P)
        if WRITE_CACHE:
            scratch = tl.load(scratch_ptr + r, mask=live, other=0)
            _store_rows(cache_ptr, scratch, y0, y1, m, D, BLOCK_P)
            ring = r < ring_rows
            slot = tl.load(ring_ptr + r, mask=ring, other=0)
            _store_rows(cache_ptr, slot, y0, y1, m & ring[:, None], D, BLOCK_P)


def attention_pre(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None,
    scratch_slots: torch.Tensor,
    ring_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of kernels.attention_pre (semantics there); cache None writes no pool."""
    n, heads, dim = q.shape
    assert q.is_contiguous() and kv.is_contiguous()
    assert cache is None or cache.is_contiguous()
    assert kv.shape == (n, dim) and ring_slots.shape[0] <= n
    q_out, kv_out = torch.empty_like(q), torch.empty_like(kv)
    if n:
        q_programs = triton.cdiv(n * heads, ROWS_PER_PROGRAM)
        _attention_pre_kernel[(q_programs + triton.cdiv(n, ROWS_PER_PROGRAM),)](
            q, kv, kv_weight.float().contiguous(), cos.contiguous(), sin.contiguous(), q_out,
            kv_out,
            kv_out if cache is None else cache,
            scratch_slots, ring_slots, n, heads, ring_slots.shape[0], q_programs, eps,
            D=dim, HALF=cos.shape[-1], BLOCK_R=ROWS_PER_PROGRAM, BLOCK_P=halves(dim),
            WRITE_CACHE=cache is not None,
            num_warps=4,
        )  # fmt: skip
    return q_out, kv_out


@triton.jit
def _rope_back_kernel(
    x_ptr, cos_ptr, sin_ptr, rows, heads, D, HALF, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rope_in_place(x_ptr, r, r < rows, r // heads, cos_ptr, sin_ptr, -1.0, D, HALF, BLOCK_H)


def attention_post(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton path of kernels.attention_post (semantics there): rotates `out` in place."""
    n, dim = out.shape[0], out.shape[-1]
    assert out.is_contiguous()
    rows, half = out.numel() // dim, cos.shape[-1]
    block_h = triton.next_power_of_2(half)
    block_r = max(1, 2048 // block_h)
    if rows:
        _rope_back_kernel[(triton.cdiv(rows, block_r),)](
            out, cos.contiguous(), sin.contiguous(), rows, rows // n, dim, half,
            BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=4,
        )  # fmt: skip
    return out
