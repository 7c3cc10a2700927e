"""Sparse-MLA decode on Hopper (Gluon): kernels.sparse_mla's contract with each MMA done once.

The Triton kernel lays its 8 warps along the heads, so with 64 heads a tile both warpgroups
compute the same QK^T, and its 64x512 fp32 accumulator leaves room for one KV stage in flight
(bench/NOTES-kernels.md). Here a CTA owns one request's 64-head tile and one split of its index
list, walked in tiles of 32 gathered KV rows, with three partitions:

- a producer warpgroup: Q once, then every tile's 32 rows gathered with cp.async (16 bytes a
  thread; rows whose slot id is -1 or outside the pool are zero-filled, never read) into a
  ring of 3-4 stages (as deep as shared memory allows beside Q), each stage completing on its
  mbarrier when the copies land;
- two consumer warpgroups w = 0, 1, each owning half of the row's columns: the value columns
  [256 w, 256 w + 256) and half of the RoPE columns. Each computes its partial QK^T over its
  columns (M = 64 heads, N = 32 rows), the two add their partials through shared memory (one
  exchange a tile), and each then holds the whole score tile: both run the same online softmax
  on the same values in the same order, so they agree exactly without trading maxima or sums.
  P stays in registers as the A operand of P.V, which each warpgroup runs for its own value
  columns, O[:, 256 w : 256 w + 256] (128 fp32 registers a thread: the split FlashMLA makes
  for the 64x512 output).

Work follows the real entries as in the Triton kernel (``lengths``, equal whole-tile shares per
split); partial results of several splits are merged by kernels.sparse_mla's combine kernel,
which applies the sinks; a single split applies them itself. Plain (bf16/fp16) pools only:
FP8 pools, other widths and head counts that are not a multiple of 64 run the Triton kernel
(``supports``). Versions and their measurements: bench/NOTES-hopper.md.
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

from dsaserve.kernels.env import num_sms
from dsaserve.kernels.softmax import LOG2E
from dsaserve.kernels.sparse_mla import combine_splits

BLOCK_H = 64  # heads a CTA: one wgmma M
BLOCK_N = 32  # gathered KV rows a tile (the N of QK^T, the K of P.V)
D_V = 512  # value width (the first 512 columns of a row); K = the whole row
D_ROPE = 64  # the RoPE columns of a 576-wide row (DeepSeek-V3.2), 32 a warpgroup


def stages_for(dim: int) -> int:
    """KV ring depth: what fits in shared memory beside Q (64 KB) and the score exchange
    (32 KB): four 32 KB stages of 512-wide rows, three 36 KB stages of 576-wide ones."""
    return 4 if dim == D_V else 3


_BLOCK_H = gl.constexpr(BLOCK_H)  # the same, for the kernels
_BLOCK_N = gl.constexpr(BLOCK_N)
_D_V = gl.constexpr(D_V)
_D_ROPE = gl.constexpr(D_ROPE)
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
        and dim in (D_V, D_V + D_ROPE)
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
    ROPE: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warpgroup: cp.async of Q (once, on q_bar) and of each tile's rows into the ring, a
    64-column block (one 128-byte swizzle atom) of all rows at a time, a warp 8 of the rows: 4
    threads a row, 16 bytes an access. Four warps, not one: a warp keeps only so many copies in
    flight, and one warp's worth left both kernels waiting on the gather
    (bench/NOTES-hopper.md). A tile's slot ids are loaded while the tile before is issued."""
    blk_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    cols = gl.arange(0, 64, gl.SliceLayout(0, blk_l))[None, :]
    rcols = gl.arange(0, _D_ROPE // 2, gl.SliceLayout(0, blk_l))[None, :]
    heads = gl.arange(0, _BLOCK_H, gl.SliceLayout(1, blk_l))
    q_rows = q_ptr + q_base + heads.to(gl.int64)[:, None] * stride_qh
    for c in gl.static_range(_D_V // 64):
        async_copy.async_copy_global_to_shared(
            q_smem.slice(64 * c, 64, dim=1), q_rows + (64 * c + cols)
        )
    if ROPE:
        for w in gl.static_range(2):
            async_copy.async_copy_global_to_shared(
                qr_smem.index(w), q_rows + (_D_V + w * (_D_ROPE // 2) + rcols)
            )
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    rows = gl.arange(0, _BLOCK_N, gl.SliceLayout(1, blk_l))
    pos = start + rows
    next_slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)
    for t in range(n_tiles):
        s = t % STAGES
        slot = next_slot
        pos = start + (t + 1) * _BLOCK_N + rows
        next_slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)
        valid = ((slot >= 0) & (slot < num_slots))[:, None]
        kv_rows = kv_ptr + slot.to(gl.int64)[:, None] * stride_kv
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        for c in gl.static_range(_D_V // 64):
            async_copy.async_copy_global_to_shared(
                kv_smem.index(s).slice(64 * c, 64, dim=1), kv_rows + (64 * c + cols), mask=valid
            )
        if ROPE:
            for w in gl.static_range(2):
                async_copy.async_copy_global_to_shared(
                    kvr_smem.index(2 * s + w), kv_rows + (_D_V + w * (_D_ROPE // 2) + rcols),
                    mask=valid,
                )  # fmt: skip
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _scores(
    q_mine, qr_smem, kv_smem, kvr_smem, ready, t, s_l: gl.constexpr,
    W: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Issue (async) warpgroup W's partial QK^T of tile t [64 heads, 32 rows] once its stage
    has landed."""
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    fence_async_shared()  # the cp.async writes, seen by the tensor cores' (async) reads
    kv_mine = kv_smem.index(s).slice(W * (_D_V // 2), _D_V // 2, dim=1)  # [32 rows, 256]
    sc = warpgroup_mma(
        q_mine, kv_mine.permute((1, 0)), gl.zeros([_BLOCK_H, _BLOCK_N], gl.float32, s_l),
        use_acc=False, is_async=True,
    )  # fmt: skip
    if ROPE:
        sc = warpgroup_mma(
            qr_smem.index(W), kvr_smem.index(2 * s + W).permute((1, 0)), sc, is_async=True
        )
    return sc


@gluon.jit
def _consumer(
    q_smem, qr_smem, kv_smem, kvr_smem, x_smem, q_bar, ready, empty, x_bar,
    idx_ptr, sink_ptr, o_ptr, lse_ptr,
    idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base, stride_oh, lse_base,
    W: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    HAS_SINKS: gl.constexpr,
):  # fmt: skip
    """Warpgroup W: columns [256 W, 256 W + 256) (and RoPE half W) of QK^T, the whole softmax,
    O[:, 256 W : 256 W + 256]."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BLOCK_N, 16]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _D_V // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    q_mine = q_smem.slice(W * (_D_V // 2), _D_V // 2, dim=1)  # [64 heads, 256]

    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    cols = gl.arange(0, _BLOCK_N, gl.SliceLayout(0, s_l))
    m = gl.full([_BLOCK_H], float("-inf"), gl.float32, row_s)
    l = gl.zeros([_BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([_BLOCK_H, _D_V // 2], gl.float32, o_l)
    pos = start + cols
    next_slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)
    mbarrier.wait(q_bar, 0)
    for t in range(n_tiles):
        # the slot ids of the next tile load while this one is computed (wgmma's register
        # fence would otherwise wait on the load at every tile)
        valid = (next_slot >= 0) & (next_slot < num_slots)
        pos = start + (t + 1) * _BLOCK_N + cols
        next_slot = gl.load(idx_ptr + idx_base + pos, mask=pos < end, other=-1)
        sc = _scores(q_mine, qr_smem, kv_smem, kvr_smem, ready, t, s_l, W, ROPE, STAGES)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))

        # the two partial sums, traded through a buffer pair that alternates by tile parity
        x_smem.index(2 * (t & 1) + W).store(sc)
        gl.thread_barrier()
        mbarrier.arrive(x_bar, count=1)
        mbarrier.wait(x_bar, t & 1)
        sc = sc + x_smem.index(2 * (t & 1) + 1 - W).load(s_l)  # a + b == b + a: both agree
        sc = gl.where(valid[None, :], sc * qk_scale, float("-inf"))  # [64, 32], base 2

        m_new = gl.maximum(m, gl.max(sc, 1))
        # all-masked so far: subtract 0 instead of -inf (kernels.softmax.softmax_step)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_ref)
        p = gl.exp2(sc - m_ref[:, None])
        l = l * alpha + gl.sum(p, 1)
        m = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_a = gl.convert_layout(p.to(kv_smem.dtype), p_l)
        kv_mine = kv_smem.index(t % STAGES).slice(W * (_D_V // 2), _D_V // 2, dim=1)
        acc = warpgroup_mma(p_a, kv_mine, acc, is_async=True)  # [64 heads, 256]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp of this group is done with the stage
        mbarrier.arrive(empty.index(t % STAGES), count=1)

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
    ROPE: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, HAS_LENGTHS: gl.constexpr,
    HAS_SINKS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(num_warps == 4)
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
    # the RoPE buffers shrink to a token size when there is no RoPE
    r_heads: gl.constexpr = _BLOCK_H if ROPE else 8
    r_rows: gl.constexpr = _BLOCK_N if ROPE else 8
    q_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, _D_V], dtype)
    r_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, _D_ROPE // 2], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, _D_V], q_l)
    qr_smem = gl.allocate_shared_memory(dtype, [2, r_heads, _D_ROPE // 2], r_l)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_N, _D_V], q_l)
    kvr_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, r_rows, _D_ROPE // 2], r_l)
    # a warp's 8 B accesses to a score tile cover 8 rows x 32 B: 32 B units swizzled over 4
    # phases put them on all 32 banks (2 wavefronts, the least for 256 B)
    x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [4, _BLOCK_H, _BLOCK_N], x_l)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    x_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    mbarrier.init(q_bar, count=128)  # one cp.async arrival a producer thread
    mbarrier.init(x_bar, count=2)  # one arrival a consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=128)
        mbarrier.init(empty.index(i), count=2)

    q_base = b * stride_qb + head0 * stride_qh
    idx_base = b * stride_ib
    o_base = b * stride_ob + split * stride_os
    lse_base = b * stride_lb + split * stride_ls
    # (one tuple literal a partition: Gluon's frontend does not concatenate tuples of constants)
    gl.warp_specialize([
        (_consumer, (q_smem, qr_smem, kv_smem, kvr_smem, x_smem, q_bar, ready, empty, x_bar,
                     idx_ptr, sink_ptr, o_ptr, lse_ptr,
                     idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base,
                     stride_oh, lse_base, 0, ROPE, STAGES, SPLIT, HAS_SINKS)),
        (_consumer, (q_smem, qr_smem, kv_smem, kvr_smem, x_smem, q_bar, ready, empty, x_bar,
                     idx_ptr, sink_ptr, o_ptr, lse_ptr,
                     idx_base, start, end, n_tiles, num_slots, qk_scale, head0, o_base,
                     stride_oh, lse_base, 1, ROPE, STAGES, SPLIT, HAS_SINKS)),
        (_producer, (q_ptr, kv_ptr, idx_ptr, q_smem, qr_smem, kv_smem, kvr_smem, q_bar, ready,
                     empty, q_base, stride_qh, stride_kv, idx_base, start, end, n_tiles,
                     num_slots, ROPE, STAGES)),
    ], [4, 4], [232, 40])  # fmt: skip


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
        ROPE=dim > D_V, STAGES=stages_for(dim), SPLIT=splits > 1,
        HAS_LENGTHS=lengths is not None,
        HAS_SINKS=sinks is not None, num_warps=4, maxnreg=168,
    )  # fmt: skip
    if splits > 1:
        combine_splits(o_buf, lse_buf, sinks, out, lse)
    return out, lse
