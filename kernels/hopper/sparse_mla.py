"""Sparse-MLA decode on Hopper (Gluon): kernels.sparse_mla's contract with each MMA done once.

The Triton kernel lays its 8 warps along the heads, so with 64 heads a tile both warpgroups
compute the same QK^T, and its 64x512 fp32 accumulator leaves room for one KV stage in flight
(bench/NOTES-kernels.md). Here a CTA owns one request's 64-head tile and one split of its index
list, walked in tiles of 64 gathered KV rows, with three partitions:

- a producer warp: Q once, then every tile's 64 rows gathered with cp.async (16 bytes a
  thread; rows whose slot id is -1 or outside the pool are zero-filled, never read) into a
  two-stage ring; each stage completes on its mbarrier when the copies land;
- two consumer warpgroups w = 0, 1. Warpgroup w scores rows [32 w, 32 w + 32) of the tile
  against all 64 heads (QK^T: M = 64 heads, N = 32 rows, K = the whole row); the two trade
  their row maxima through shared memory, so both hold the same running max; each writes its
  P half (bf16) to shared memory; then each runs P.V over all 64 rows for its half of the value
  columns, O[:, 256 w : 256 w + 256] (128 fp32 registers a thread: the split FlashMLA makes
  for the 64x512 output). Each warpgroup keeps the row sums of its own rows; they are added at
  the end. Both compute the max, the rescale and the normalisation from the same values in the
  same order, so they agree exactly.

Work follows the real entries as in the Triton kernel (``lengths``, equal whole-tile shares per
split); partial results of several splits are merged by kernels.sparse_mla's combine kernel,
which applies the sinks; a single split applies them itself. Plain (bf16/fp16) pools only:
FP8 pools, other widths and head counts that are not a multiple of 64 run the Triton kernel
(``supports``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.env import num_sms
from kernels.softmax import LOG2E
from kernels.sparse_mla import combine_splits

BLOCK_H = 64  # heads a CTA: one wgmma M
BLOCK_N = 64  # gathered KV rows a tile: 32 a consumer warpgroup
D_V = 512  # value width (the first 512 columns of a row); K = the whole row
STAGES = 2  # KV ring depth: Q (64-72 KB) + 2 stages (128-144 KB) fill shared memory
_BLOCK_H = gl.constexpr(BLOCK_H)  # the same, for the kernels
_BLOCK_N = gl.constexpr(BLOCK_N)
_D_V = gl.constexpr(D_V)
_STAGES = gl.constexpr(STAGES)
_LN2 = gl.constexpr(0.6931471805599453)
_LOG2E = gl.constexpr(LOG2E)


def supports(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether this kernel takes the call: a plain bf16/fp16 pool of 512- or 576-wide rows,
    d_v = 512, heads a multiple of 64."""
    batch, heads, dim = q.shape
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and kv.dtype == q.dtype
        and d_v == D_V
        and dim in (D_V, D_V + 64)
        and heads % BLOCK_H == 0
    )


def default_splits(batch: int, heads: int, num_idx: int, device: torch.device) -> int:
    """Splits of each index list: one CTA an SM (shared memory), so split while the grid fits
    one wave, keeping >= 2 tiles a split. Shape-only, so a captured graph keeps it."""
    programs = batch * (heads // BLOCK_H)
    return max(1, min(num_sms(device) // programs, triton.cdiv(num_idx, 2 * BLOCK_N), 32))


@gluon.jit
def _producer(
    q_ptr, kv_ptr, idx_ptr, q_smem, qr_smem, kv_smem, kvr_smem, q_bar, ready, empty,
    q_base, stride_qh, stride_kv, idx_base, start, end, n_tiles, num_slots,
    D_ROPE: gl.constexpr,
):  # fmt: skip
    """One warp: cp.async of Q (once, on q_bar) and of each tile's rows into the ring, one
    64-column block (a 128-byte swizzle atom) of all 64 rows at a time: 4 threads a row, 16
    bytes an access, so a thread holds the slot ids of 8 rows."""
    blk_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])  # [64 rows, 64 cols]
    rows = gl.arange(0, _BLOCK_N, gl.SliceLayout(1, blk_l))
    cols = gl.arange(0, 64, gl.SliceLayout(0, blk_l))[None, :]
    q_rows = q_ptr + q_base + rows.to(gl.int64)[:, None] * stride_qh
    for c in gl.static_range(_D_V // 64):
        async_copy.async_copy_global_to_shared(
            q_smem.slice(64 * c, 64, dim=1), q_rows + (64 * c + cols)
        )
    if D_ROPE > 0:
        async_copy.async_copy_global_to_shared(qr_smem, q_rows + (_D_V + cols))
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    for t in range(n_tiles):
        s = t % _STAGES
        pos = start + t * _BLOCK_N + rows
        slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)  # before the wait
        valid = ((slot >= 0) & (slot < num_slots))[:, None]
        kv_rows = kv_ptr + slot.to(gl.int64)[:, None] * stride_kv
        mbarrier.wait(empty.index(s), ((t // _STAGES) & 1) ^ 1)
        for c in gl.static_range(_D_V // 64):
            async_copy.async_copy_global_to_shared(
                kv_smem.index(s).slice(64 * c, 64, dim=1), kv_rows + (64 * c + cols), mask=valid
            )
        if D_ROPE > 0:
            async_copy.async_copy_global_to_shared(
                kvr_smem.index(s), kv_rows + (_D_V + cols), mask=valid
            )
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _consumer(
    q_smem, qr_smem, kv_smem, kvr_smem, p_smem, x_smem, q_bar, ready, empty, m_bar, p_bar,
    idx_ptr, sink_ptr, o_ptr, lse_ptr,
    idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base, stride_oh, lse_base,
    W: gl.constexpr, D_ROPE: gl.constexpr, SPLIT: gl.constexpr, HAS_SINKS: gl.constexpr,
):  # fmt: skip
    """Warpgroup W: scores of rows [32 W, 32 W + 32) of each tile, O[:, 256 W : 256 W + 256]."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BLOCK_N // 2, 16]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _D_V // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    cols = gl.arange(0, _BLOCK_N // 2, gl.SliceLayout(0, s_l))

    m = gl.full([_BLOCK_H], float("-inf"), gl.float32, row_s)
    l = gl.zeros([_BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([_BLOCK_H, _D_V // 2], gl.float32, o_l)
    mbarrier.wait(q_bar, 0)
    for t in range(n_tiles):
        s = t % _STAGES
        phase = t & 1
        pos = start + t * _BLOCK_N + W * (_BLOCK_N // 2) + cols
        slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)
        valid = (slot >= 0) & (slot < num_slots)
        mbarrier.wait(ready.index(s), (t // _STAGES) & 1)
        fence_async_shared()  # the cp.async writes, seen by the tensor cores' (async) reads
        mine = kv_smem.index(s).slice(W * (_BLOCK_N // 2), _BLOCK_N // 2)
        sc = warpgroup_mma(
            q_smem, mine.permute((1, 0)), gl.zeros([_BLOCK_H, _BLOCK_N // 2], gl.float32, s_l),
            use_acc=False, is_async=True,
        )  # fmt: skip
        if D_ROPE > 0:
            mine_r = kvr_smem.index(s).slice(W * (_BLOCK_N // 2), _BLOCK_N // 2)
            sc = warpgroup_mma(qr_smem, mine_r.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        sc = gl.where(valid[None, :], sc * qk_scale, float("-inf"))  # [64, 32], base 2

        # the running max over both warpgroups' rows
        x_smem.index(W).store(gl.max(sc, 1))
        gl.thread_barrier()
        mbarrier.arrive(m_bar, count=1)
        mbarrier.wait(m_bar, phase)
        tile_max = gl.maximum(x_smem.index(0).load(row_s), x_smem.index(1).load(row_s))
        m_new = gl.maximum(m, tile_max)
        # all-masked so far: subtract 0 instead of -inf (kernels.softmax.softmax_step)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_ref)
        p = gl.exp2(sc - m_ref[:, None])
        l = l * alpha + gl.sum(p, 1)
        m = m_new

        p_smem.index(W).store(p.to(p_smem.dtype))
        fence_async_shared()  # P's stores, seen by the MMAs of both warpgroups
        gl.thread_barrier()
        mbarrier.arrive(p_bar, count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(p_bar, phase)
        v = kv_smem.index(s).slice(W * (_D_V // 2), _D_V // 2, dim=1)  # [64 rows, 256]
        half: gl.constexpr = _BLOCK_N // 2
        acc = warpgroup_mma(p_smem.index(0), v.slice(0, half), acc, is_async=True)
        acc = warpgroup_mma(p_smem.index(1), v.slice(half, half), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp of this group is done with stage s
        mbarrier.arrive(empty.index(s), count=1)

    # the row sums of both halves, traded like the maxima
    x_smem.index(W).store(l)
    gl.thread_barrier()
    mbarrier.arrive(m_bar, count=1)
    mbarrier.wait(m_bar, n_tiles & 1)
    l = x_smem.index(0).load(row_s) + x_smem.index(1).load(row_s)
    seen = l > 0
    l_safe = gl.where(seen, l, 1.0)
    lse2 = gl.where(seen, m + gl.log2(l_safe), float("-inf"))  # [64], base 2
    heads = head0 + gl.arange(0, _BLOCK_H, row_s)
    if not SPLIT and HAS_SINKS:  # kernels.softmax.finalize
        sink2 = gl.load(sink_ptr + heads).to(gl.float32) * _LOG2E
        l_safe = l_safe * (1.0 + gl.exp2(sink2 - lse2))
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    o_heads = head0 + gl.arange(0, _BLOCK_H, row_o)
    o_cols = W * (_D_V // 2) + gl.arange(0, _D_V // 2, gl.SliceLayout(0, o_l))
    o_ptrs = o_ptr + o_base + o_heads.to(gl.int64)[:, None] * stride_oh + o_cols[None, :]
    gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
    if W == 0:
        gl.store(lse_ptr + lse_base + heads, lse2 if SPLIT else lse2 * _LN2)


@gluon.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_ib, stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    num_slots, num_idx, qk_scale, head_tiles, num_splits,
    D_ROPE: gl.constexpr, SPLIT: gl.constexpr, HAS_LENGTHS: gl.constexpr,
    HAS_SINKS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(num_warps == 4)
    R_ALLOC: gl.constexpr = D_ROPE if D_ROPE > 0 else 16  # a token buffer when there is no rope
    b = (gl.program_id(0) // head_tiles).to(gl.int64)
    head0 = (gl.program_id(0) % head_tiles) * _BLOCK_H
    split = gl.program_id(1)
    n = num_idx
    if HAS_LENGTHS:
        n = gl.minimum(gl.load(len_ptr + b), num_idx)
    per_split = gl.cdiv(gl.cdiv(n, num_splits), _BLOCK_N) * _BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, n)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), _BLOCK_N)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, _D_V], dtype)
    qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, R_ALLOC], dtype)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, _BLOCK_N // 2], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, _D_V], q_l)
    qr_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, R_ALLOC], qr_l)
    kv_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, _D_V], q_l)
    kvr_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, R_ALLOC], qr_l)
    p_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_H, _BLOCK_N // 2], p_l)
    x_smem = gl.allocate_shared_memory(
        gl.float32, [2, _BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    m_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    p_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], bar_l)
    mbarrier.init(q_bar, count=32)  # one cp.async arrival a producer thread
    mbarrier.init(m_bar, count=2)  # one arrival a consumer warpgroup
    mbarrier.init(p_bar, count=2)
    for i in gl.static_range(_STAGES):
        mbarrier.init(ready.index(i), count=32)
        mbarrier.init(empty.index(i), count=2)

    q_base = b * stride_qb + head0 * stride_qh
    idx_base = b * stride_ib
    o_base = b * stride_ob + split * stride_os
    lse_base = b * stride_lb + split * stride_ls
    # (one tuple literal a partition: Gluon's frontend does not concatenate tuples of constants)
    gl.warp_specialize([
        (_consumer, (q_smem, qr_smem, kv_smem, kvr_smem, p_smem, x_smem, q_bar, ready, empty,
                     m_bar, p_bar, idx_ptr, sink_ptr, o_ptr, lse_ptr,
                     idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base,
                     stride_oh, lse_base, 0, D_ROPE, SPLIT, HAS_SINKS)),
        (_consumer, (q_smem, qr_smem, kv_smem, kvr_smem, p_smem, x_smem, q_bar, ready, empty,
                     m_bar, p_bar, idx_ptr, sink_ptr, o_ptr, lse_ptr,
                     idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base,
                     stride_oh, lse_base, 1, D_ROPE, SPLIT, HAS_SINKS)),
        (_producer, (q_ptr, kv_ptr, idx_ptr, q_smem, qr_smem, kv_smem, kvr_smem, q_bar, ready,
                     empty, q_base, stride_qh, stride_kv, idx_base, start, end, n_tiles,
                     num_slots, D_ROPE)),
    ], [4, 1], [232, 40])  # fmt: skip


def sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    sinks: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon sparse-MLA decode on an sm_90 device; semantics in
    kernels.dispatch.sparse_mla_decode, shapes in ``supports``. No host synchronisation:
    graph-capturable."""
    assert supports(q, kv, d_v), "shape or dtype not taken: use kernels.sparse_mla"
    assert indices.dim() == 2 and indices.shape[0] == q.shape[0]
    assert indices.dtype == torch.int32
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    batch, heads, dim = q.shape
    num_idx = indices.shape[1]
    splits = num_splits or default_splits(batch, heads, num_idx, q.device)
    head_tiles = heads // BLOCK_H
    out = torch.empty(batch, heads, d_v, dtype=q.dtype, device=q.device)  # [B, H, d_v]
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)  # [B, H]
    if splits == 1:
        o_buf, lse_buf = out.unsqueeze(1), lse.unsqueeze(1)
    else:  # partials, normalised, base-2 lse
        o_buf = torch.empty(batch, splits, heads, d_v, dtype=torch.float32, device=q.device)
        lse_buf = torch.empty(batch, splits, heads, dtype=torch.float32, device=q.device)
    dummy = lse  # stands in for absent optional pointers; never read
    _sparse_mla_kernel[(batch * head_tiles, splits)](
        q, kv, indices,
        dummy if lengths is None else lengths,
        dummy if sinks is None else sinks,
        o_buf, lse_buf,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), lse_buf.stride(0), lse_buf.stride(1),
        kv.shape[0], num_idx, sm_scale * LOG2E, head_tiles, splits,
        D_ROPE=dim - D_V, SPLIT=splits > 1, HAS_LENGTHS=lengths is not None,
        HAS_SINKS=sinks is not None, num_warps=4, maxnreg=168,
    )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, lse_buf, sinks, out, lse)
    return out, lse
