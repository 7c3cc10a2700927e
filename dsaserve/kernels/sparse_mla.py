"""Sparse-MLA decode on tensor cores (Triton).

All query heads of a request share one KV head (MQA), so a program owns one request and a tile of
up to 64 heads: it gathers a tile of BLOCK_N KV rows once and feeds every head through ``tl.dot``
(QK^T, then PV with V = the first d_v columns of the same tile), with fp32 accumulators and an
online softmax. When batch x head tiles cannot fill the GPU, the index list is split across
programs (split-K) and a combine kernel merges the partial results by log-sum-exp and applies the
sinks; otherwise the single pass applies them itself.

Work follows the real entries: each row reads only ``indices[b, :lengths[b]]``, split into equal
whole tiles. The grid and every buffer follow the input shapes only, and the wrapper does no host
synchronisation, so a call can be captured in a CUDA graph. The same kernel serves prefill (one
row per prompt token, B in the thousands, no split).

The pool is plain ([S, D], q's dtype) or FP8 (uint8 pages, kernels.kv_quant: V4's 584-byte rows
or V3.2's 656-byte ones): the one tile loop reads any of them through ``_load_rows``, a constexpr
switch; the FP8 loaders dequantize each gathered tile to q's dtype (exactly: an e4m3 code times a
power of two fits bf16) before the same dots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels.env import INTERPRET, dot_precision, num_sms
from dsaserve.kernels.kv_quant import KV_DIM, V32_DIM, kv_page_size, load_kv_fp8, load_kv_v32_fp8
from dsaserve.kernels.softmax import LOG2E, finalize, normalize, softmax_step

# Most slot ids one program loads (once, into registers): longer index lists get more splits.
IDX_CHUNK_MAX = 2048
# What a pool's rows are (the kernels' KV_FP8 switch): plain rows, V4's FP8, V3.2's FP8.
PLAIN, FP8_V4, FP8_V32 = 0, 1, 2


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int  # heads per program: 64 lets one wgmma cover them
    block_n: int  # gathered KV rows per step
    num_splits: int  # programs per (request, head tile) along the index list
    num_warps: int
    num_stages: int


def default_config(
    batch: int, heads: int, num_idx: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> DecodeConfig:
    """Shape-only choice (no data read), so a captured graph keeps it."""
    wide = dtype.itemsize > 2  # fp32 (tests): small tiles, to fit shared memory
    block_h = 16 if wide else next(b for b in (64, 32, 16) if heads % b == 0)
    programs = batch * (heads // block_h)
    # one program per SM fits (shared memory), so split while the grid stays one wave, keeping
    # >= 128 entries per split
    num_splits = max(1, min(num_sms(device) // programs, num_idx // 128, 32))
    return DecodeConfig(block_h, 16 if wide else 32, num_splits, 8 if block_h == 64 else 4, 3)


@triton.jit
def _load_rows(
    kv_ptr,
    slot, valid,
    stride_kv,
    cols,
    KV_FP8: tl.constexpr, PAGE: tl.constexpr, DTYPE: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Columns `cols` of the KV rows at slot [BLOCK_N] as DTYPE, 0 where not valid: a plain pool
    is [S, D] with row stride stride_kv; an FP8 pool follows kernels.kv_quant (page stride
    stride_kv, P = PAGE) and cols must then be all 512 columns (FP8_V4), or the 512 latent
    columns or (ROPE) the 64 RoPE ones (FP8_V32)."""
    if KV_FP8 == 2:  # (FP8_V32)
        return load_kv_v32_fp8(kv_ptr, slot, valid, stride_kv, PAGE, DTYPE, ROPE)
    elif KV_FP8 == 1:  # (FP8_V4)
        return load_kv_fp8(kv_ptr, slot, valid, stride_kv, PAGE, DTYPE)
    else:
        rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
        return tl.load(rows + cols[None, :], mask=valid[:, None], other=0.0).to(DTYPE)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_ib,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    num_slots, num_idx, qk_scale, head_tiles, num_splits,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IDX_CHUNK: tl.constexpr, SPLIT: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr, PAGE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # head tiles of one request are adjacent in launch order, so they share gathered rows in L2
    b = (tl.program_id(0) // head_tiles).to(tl.int64)
    heads = (tl.program_id(0) % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    offs_v = tl.arange(0, D_V)

    n = num_idx
    if HAS_LENGTHS:
        n = tl.minimum(tl.load(len_ptr + b), num_idx)
    # equal shares of the real entries, in whole tiles
    per_split = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n)

    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_v[None, :])  # [BLOCK_H, D_V]
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
    if D_ROPE > 0:
        offs_r = D_V + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_rows + offs_r[None, :])  # [BLOCK_H, D_ROPE]
        if UPCAST:
            q_rope = q_rope.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    # All of this program's slot ids in one load (the wrapper sizes IDX_CHUNK to hold them);
    # tiles take theirs from registers (tl.gather), so the pipelined KV gathers below never
    # wait on an index load.
    offs_c = start + tl.arange(0, IDX_CHUNK)
    chunk = tl.load(idx_ptr + b * stride_ib + offs_c, mask=offs_c < end, other=-1)
    for t0 in range(0, end - start, BLOCK_N):
        # clamped: the pipeliner runs the gather for iterations past the end (their loads are
        # predicated off), and an index past the chunk faulted on the H200
        slot = tl.gather(chunk, tl.minimum(t0 + tl.arange(0, BLOCK_N), IDX_CHUNK - 1), 0)
        valid = (slot >= 0) & (slot < num_slots)
        # K and V, in q's dtype (fp32 under the interpreter)
        kv_nope = _load_rows(
            kv_ptr, slot, valid, stride_kv, offs_v, KV_FP8, PAGE, q_nope.dtype, False
        )
        s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
        if D_ROPE > 0:
            k_rope = _load_rows(
                kv_ptr, slot, valid, stride_kv, offs_r, KV_FP8, PAGE, q_rope.dtype, True
            )
            s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        p, alpha, m, l = softmax_step(s, m, l)
        acc = tl.dot(
            p.to(kv_nope.dtype), kv_nope, acc=acc * alpha[:, None], input_precision=DOT_PRECISION
        )

    o, lse2 = normalize(acc, m, l)
    o_rows = (
        o_ptr + b * stride_ob + split * stride_os + heads[:, None] * stride_oh + offs_v[None, :]
    )
    lse_row = lse_ptr + b * stride_lb + split * stride_ls + heads
    if not SPLIT:
        out, lse = finalize(o, lse2, sink_ptr, heads, HAS_SINKS)
        tl.store(o_rows, out.to(o_ptr.dtype.element_ty))
        tl.store(lse_row, lse)
    else:  # partial results, normalised, with base-2 lse
        tl.store(o_rows, o)
        tl.store(lse_row, lse2)


@triton.jit
def _combine_kernel(
    o_part_ptr, lse_part_ptr, sink_ptr, out_ptr, lse_ptr,
    stride_pb, stride_ps, stride_ph, stride_qb, stride_qs,
    stride_ob, stride_oh, stride_lb, head_tiles, num_splits,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b = (tl.program_id(0) // head_tiles).to(tl.int64)
    heads = (tl.program_id(0) % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, D_V)
    lse_parts = lse_part_ptr + b * stride_qb + heads  # + split * stride_qs

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        m = tl.maximum(m, tl.load(lse_parts + split * stride_qs))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for split in range(num_splits):
        w = tl.exp2(tl.load(lse_parts + split * stride_qs) - m_ref)  # [BLOCK_H]; 0 if empty
        o = tl.load(
            o_part_ptr
            + b * stride_pb
            + split * stride_ps
            + heads[:, None] * stride_ph
            + offs_v[None, :]
        )
        total += w
        acc += w[:, None] * o
    o, lse2 = normalize(acc, m_ref, total)
    out, lse = finalize(o, lse2, sink_ptr, heads, HAS_SINKS)
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_v[None, :],
        out.to(out_ptr.dtype.element_ty),
    )
    tl.store(lse_ptr + b * stride_lb + heads, lse)


def combine_splits(
    o_buf: torch.Tensor,
    lse_buf: torch.Tensor,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge the splits' partial results (o_buf fp32 [B, splits, H, d_v], normalised; lse_buf
    [B, splits, H], base 2) into out [B, H, d_v] and the natural lse [B, H], applying the sinks."""
    batch, num_splits, heads, d_v = o_buf.shape
    block_h = 16
    _combine_kernel[(batch * heads // block_h,)](
        o_buf, lse_buf,
        lse if sinks is None else sinks,  # (lse stands in for no sinks; never read)
        out, lse,
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), lse_buf.stride(0), lse_buf.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        heads // block_h, num_splits,
        D_V=d_v, BLOCK_H=block_h, HAS_SINKS=sinks is not None,
        num_warps=4,
    )  # fmt: skip


def supports(heads: int, dim: int, d_v: int) -> bool:
    """Whether the kernel's tiling covers this head count and width (check_decode_args' rules)."""
    d_rope = dim - d_v
    return (
        heads % 16 == 0
        and d_v >= 16
        and d_v & (d_v - 1) == 0
        and (d_rope == 0 or (d_rope >= 16 and d_rope & (d_rope - 1) == 0))
    )


def check_decode_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> int:
    """Validate shapes (no data read); return the rope width D - d_v."""
    batch, heads, dim = q.shape
    if kv.dtype == torch.uint8:  # FP8 pool: V4's (K = V = the whole 512-wide row) or V3.2's
        assert (dim, d_v) in ((KV_DIM, KV_DIM), (V32_DIM, KV_DIM)), (
            f"an FP8 pool holds {KV_DIM}-wide rows (d_v {KV_DIM}) or {V32_DIM}-wide ones "
            f"(d_v {KV_DIM}): q {dim}, d_v {d_v}"
        )
        kv_page_size(kv, dim)
        assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), q.dtype
    else:
        assert kv.dim() == 2 and kv.shape[1] == dim, f"kv {tuple(kv.shape)} vs q {tuple(q.shape)}"
        assert kv.dtype == q.dtype, f"kv {kv.dtype} vs q {q.dtype}"
    assert indices.dim() == 2 and indices.shape[0] == batch and indices.dtype == torch.int32
    assert heads % 16 == 0, f"heads must be a multiple of 16, got {heads}"
    d_rope = dim - d_v
    assert d_v >= 16 and d_v & (d_v - 1) == 0, f"d_v must be a power of two, got {d_v}"
    assert d_rope == 0 or (d_rope >= 16 and d_rope & (d_rope - 1) == 0), f"D - d_v = {d_rope}"
    return d_rope


def sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    sinks: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton sparse-MLA decode; semantics in kernels.dispatch.sparse_mla_decode."""
    d_rope = check_decode_args(q, kv, indices, d_v)
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    batch, heads, dim = q.shape
    kv_fp8 = PLAIN if kv.dtype != torch.uint8 else FP8_V32 if dim == V32_DIM else FP8_V4
    page = kv_page_size(kv, dim) if kv_fp8 else 1  # slots per row of kv
    num_idx = indices.shape[1]
    cfg = config or default_config(batch, heads, num_idx, q.device, q.dtype)
    # every program's share of the index list must fit its one load of slot ids
    num_splits = max(cfg.num_splits, triton.cdiv(num_idx, IDX_CHUNK_MAX))
    share = triton.cdiv(triton.cdiv(num_idx, num_splits), cfg.block_n) * cfg.block_n
    # a power of two, at least one slot id per thread
    idx_chunk = triton.next_power_of_2(max(share, 32 * cfg.num_warps))
    head_tiles = heads // cfg.block_h
    out = torch.empty(batch, heads, d_v, dtype=q.dtype, device=q.device)  # [B, H, d_v]
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)  # [B, H]
    if num_splits == 1:
        o_buf, lse_buf = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        o_buf = torch.empty(
            batch, num_splits, heads, d_v, dtype=torch.float32, device=q.device
        )  # [B, splits, H, d_v]
        lse_buf = torch.empty(
            batch, num_splits, heads, dtype=torch.float32, device=q.device
        )  # [B, splits, H]
    dummy = lse  # stands in for absent optional pointers; never read
    _sparse_mla_kernel[(batch * head_tiles, num_splits)](
        q, kv, indices,
        dummy if lengths is None else lengths,
        dummy if sinks is None else sinks,
        o_buf, lse_buf,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), o_buf.stride(0), o_buf.stride(1),
        o_buf.stride(2), lse_buf.stride(0), lse_buf.stride(1),
        kv.shape[0] * page, num_idx, sm_scale * LOG2E, head_tiles, num_splits,
        D_V=d_v, D_ROPE=d_rope, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, IDX_CHUNK=idx_chunk,
        SPLIT=num_splits > 1, HAS_LENGTHS=lengths is not None, HAS_SINKS=sinks is not None,
        KV_FP8=kv_fp8, PAGE=page, UPCAST=INTERPRET, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits(o_buf, lse_buf, sinks, out, lse)
    return out, lse
