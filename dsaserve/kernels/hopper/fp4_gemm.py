"""The grouped FP4 GEMM on Hopper (Gluon): out[split, sorted row, weight row] = one K slice of
each expert's FP4 weights times its rows' activations, for kernels.hopper.fp4_moe.

It swaps A and B: the weights are the MMA's M side (128 rows a work item: two halves of 64,
gate rows j and up rows I + j, or 128 consecutive rows of w2), a slot's <= BT sorted token rows
its N side. A persistent CTA walks its work items (slot, K slice, 128-row tile) as one flat
sequence of 512-wide K steps. Three partitions: a producer warp keeps a TMA ring STAGES deep
(each stage: the step's packed weights, their scales and the activation tile, on one mbarrier)
running ahead across item boundaries, and two consumer warpgroups, one per 64-row half, each on
its own: it decodes its packed bytes into ``warpgroup_mma``'s register A operand
(kernels.hopper.fp4_decode), runs the MMAs against the activation tile (decoding the next part
while one runs), releases the stage, and at an item's last step stores its fp32 sums.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsaserve.kernels.env import num_sms
from dsaserve.kernels.hopper.fp4_decode import (
    DECODES,
    col_layout,
    decode_shift,
    decode_table,
    fp8_substep,
)
from dsaserve.kernels.hopper.moe_rows import MoePlan
from dsaserve.kernels.quant import FP8_BLOCK

STEP_K = 512  # K per pipeline stage (its 16 scale bytes per row are TMA's minimum box width)
SUB_K = 256  # K per decode + MMA sub-step (two per stage)
TILE_ROWS = 128  # weight rows per work item: two halves of 64, one per consumer warpgroup
SMEM_BUDGET = 220 * 1024  # of the H200's 227 KB per block
_STEP_K = gl.constexpr(STEP_K)  # the same, for the kernels
_SUB_K = gl.constexpr(SUB_K)


def stage_bytes(block_t: int, decode: str) -> int:
    """Shared memory of one ring stage: packed weights, their scales, activations (bf16, or
    e4m3 codes and one fp32 scale per 128)."""
    weights = TILE_ROWS * STEP_K // 2 + TILE_ROWS * STEP_K // 32
    if decode == "fp8":
        return weights + block_t * STEP_K + block_t * STEP_K // FP8_BLOCK * 4
    return weights + block_t * STEP_K * 2


@gluon.jit
def _item_of(step, pid, nprog, ksteps, NT: gl.constexpr, SPLITS: gl.constexpr):
    """Flat step of this CTA -> (slot, K slice, row tile, K step within the item)."""
    item = pid + (step // ksteps) * nprog
    slot = item // (SPLITS * NT)
    rem = item % (SPLITS * NT)
    return slot, rem // NT, rem % NT, step % ksteps


@gluon.jit
def _producer(
    w_desc, s_desc, x_desc, xs_desc, w_smem, s_smem, x_smem, xs_smem, ready, empty,
    slot_ptr, pid, nprog, ksteps, total, n_w, half_off, tile_stride, k_item,
    NT: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr,
    DECODE: gl.constexpr,
):  # fmt: skip
    """One warp: the TMA loads of each flat step into its ring stage, once both consumers have
    released the stage. Stage bytes: two SUB_K halves of packed weights (gate and up rows, or
    two 64-row halves), their activation tiles, and the step's 16 scale bytes per row."""
    e = 0
    row0 = 0
    for step in range(total):
        slot, split, nt, kk = _item_of(step, pid, nprog, ksteps, NT, SPLITS)
        if kk == 0:
            e = gl.load(slot_ptr + 3 * slot)
            row0 = gl.load(slot_ptr + 3 * slot + 1)
        wrow = e * n_w + nt * tile_stride
        k = split * k_item + kk * _STEP_K
        s = step % STAGES
        mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(
            bar,
            4 * w_desc.block_type.nbytes
            + 2 * x_desc.block_type.nbytes
            + 2 * s_desc.block_type.nbytes
            + (xs_desc.block_type.nbytes if DECODE == 2 else 0),
        )
        for h in gl.static_range(2):
            w_buf = w_smem.index(2 * s + h)
            tma.async_copy_global_to_shared(
                w_desc, [wrow, k // 2 + h * _SUB_K // 2], bar, w_buf.slice(0, 64)
            )
            tma.async_copy_global_to_shared(
                w_desc, [wrow + half_off, k // 2 + h * _SUB_K // 2], bar, w_buf.slice(64, 64)
            )
            tma.async_copy_global_to_shared(
                x_desc, [row0, k + h * _SUB_K], bar, x_smem.index(2 * s + h)
            )
        s_buf = s_smem.index(s)
        tma.async_copy_global_to_shared(s_desc, [wrow, k // 32], bar, s_buf.slice(0, 64))
        tma.async_copy_global_to_shared(
            s_desc, [wrow + half_off, k // 32], bar, s_buf.slice(64, 64)
        )
        if DECODE == 2:
            tma.async_copy_global_to_shared(xs_desc, [row0, k // 128], bar, xs_smem.index(s))


@gluon.jit
def _consumer(
    w_smem, s_smem, x_smem, xs_smem, ready, empty, out_ptr, slot_ptr,
    pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
    HALF: gl.constexpr, NT: gl.constexpr, SPLITS: gl.constexpr,
    STAGES: gl.constexpr, BT: gl.constexpr, DECODE: gl.constexpr,
):  # fmt: skip
    """One warpgroup, rows [64 HALF, 64 HALF + 64) of each tile: decode each stage's weights
    into registers, MMA against its activation tile, release the stage; at an item's last
    step store its fp32 sums."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32 if DECODE == 2 else 16]
    )
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    rows = gl.arange(0, 64, gl.SliceLayout(1, MMA))
    cols = gl.arange(0, BT, gl.SliceLayout(0, MMA))
    acc = gl.zeros([64, BT], gl.float32, MMA)
    for step in range(total):
        slot, split, nt, kk = _item_of(step, pid, nprog, ksteps, NT, SPLITS)
        row0 = gl.load(slot_ptr + 3 * slot + 1)  # read early: the latency hides behind the step
        row_end = gl.load(slot_ptr + 3 * slot + 2)
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        s_half = s_smem.index(s).slice(64 * HALF, 64)
        w0 = w_smem.index(2 * s).slice(64 * HALF, 64)
        w1 = w_smem.index(2 * s + 1).slice(64 * HALF, 64)
        if DECODE == 2:
            acc = gl.where(kk > 0, acc, 0.0)
            xs_tile = xs_smem.index(s)  # [BT, 4]: the step's four 128-blocks
            for h in gl.static_range(2):
                as0 = gl.convert_layout(
                    gl.reshape(xs_tile.slice(2 * h, 1, dim=1).load(col_layout(BT)), [BT]), COLS
                )
                as1 = gl.convert_layout(
                    gl.reshape(xs_tile.slice(2 * h + 1, 1, dim=1).load(col_layout(BT)), [BT]), COLS
                )
                acc = fp8_substep(
                    acc,
                    w_smem.index(2 * s + h).slice(64 * HALF, 64),
                    x_smem.index(2 * s + h),
                    s_half.slice(8 * h, 8, dim=1),
                    as0,
                    as1,
                    MMA,
                )
        else:
            if DECODE == 0:
                a0 = decode_table(w0, s_half.slice(0, 8, dim=1), A_LAYOUT)
            else:
                a0 = decode_shift(w0, s_half.slice(0, 8, dim=1), A_LAYOUT)
            acc = warpgroup_mma(
                a0, x_smem.index(2 * s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
            )
            if DECODE == 0:  # the second half decodes while the first MMA runs
                a1 = decode_table(w1, s_half.slice(8, 8, dim=1), A_LAYOUT)
            else:
                a1 = decode_shift(w1, s_half.slice(8, 8, dim=1), A_LAYOUT)
            acc = warpgroup_mma(a1, x_smem.index(2 * s + 1).permute((1, 0)), acc, is_async=True)
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))
        gl.thread_barrier()  # every warp of this group is done with stage s ...
        fence_async_shared()  # ... and its reads are ordered before the TMA that refills it
        mbarrier.arrive(empty.index(s), count=1)
        if kk == ksteps - 1:
            srow = row0 + cols
            ptr = (
                out_ptr
                + split.to(gl.int64) * stride_os
                + srow[None, :].to(gl.int64) * stride_or
                + (nt * tile_stride + HALF * half_off + rows)[:, None]
            )
            gl.store(ptr, acc, mask=(srow < row_end)[None, :])


@gluon.jit
def _fp4_gemm_kernel(
    w_desc, s_desc, x_desc, xs_desc, out_ptr, slot_ptr, nslot_ptr,
    n_w, half_off, tile_stride, k_item, stride_os, stride_or,
    NT: gl.constexpr, SPLITS: gl.constexpr, BT: gl.constexpr,
    STAGES: gl.constexpr, DECODE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """out[split, sorted row, weight row] = sum over the split's K of w[e, row, k] x[row, k]
    for every real slot (slot_ptr: int32 [S, 3] expert, first row, end of the expert's rows;
    nslot_ptr: the number of real slots). Weight rows of a tile: tile_stride * nt + [0, 64) and
    half_off + tile_stride * nt + [0, 64). Persistent: CTA pid takes items pid, pid + nprog, ..."""
    gl.static_assert(num_warps == 4)
    w_smem = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 128, _SUB_K // 2], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BT, _SUB_K], x_desc.layout)
    xs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BT, _STEP_K // 128], xs_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 128, _STEP_K // 32], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = k_item // _STEP_K
    n_items = gl.load(nslot_ptr) * (SPLITS * NT)
    total = (gl.maximum(n_items - pid + nprog - 1, 0) // nprog) * ksteps

    # (one tuple literal a partition: Gluon's frontend does not concatenate tuples of constants)
    gl.warp_specialize([
        (_consumer, (w_smem, s_smem, x_smem, xs_smem, ready, empty, out_ptr, slot_ptr,
                     pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
                     0, NT, SPLITS, STAGES, BT, DECODE)),
        (_consumer, (w_smem, s_smem, x_smem, xs_smem, ready, empty, out_ptr, slot_ptr,
                     pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
                     1, NT, SPLITS, STAGES, BT, DECODE)),
        (_producer, (w_desc, s_desc, x_desc, xs_desc, w_smem, s_smem, x_smem, xs_smem, ready,
                     empty, slot_ptr, pid, nprog, ksteps, total, n_w, half_off, tile_stride,
                     k_item, NT, SPLITS, STAGES, DECODE)),
    ], [4, 1], [168, 40])  # fmt: skip

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def weight_descriptors(w: torch.Tensor, s: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """w [E, N, K/2] packed codes, s [E, N, K/32] e8m0 -> TMA descriptors over [E * N, ...]."""
    e, n, kh = w.shape
    w2d = w.view(torch.uint8).reshape(e * n, kh)
    s2d = s.view(torch.uint8).reshape(e * n, s.shape[-1])
    w_layout = gl.NVMMASharedLayout.get_default_for([64, SUB_K // 2], gl.uint8)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return (
        TensorDescriptor.from_tensor(w2d, [64, SUB_K // 2], w_layout),
        TensorDescriptor.from_tensor(s2d, [64, STEP_K // 32], s_layout),
    )


def grouped_gemm(
    w: torch.Tensor,
    s: torch.Tensor,
    xg: torch.Tensor,
    xs: torch.Tensor,
    p: MoePlan,
    gate_up: bool,
    split: int,
    block_t: int,
    stages: int,
    decode: str,
) -> torch.Tensor:
    """fp32 [split, R, N] sums over each K slice of w[e] (N rows, K/2 packed bytes, scales s)
    times the MMA-ordered activations xg [R, K] (scales xs for "fp8"), for the valid rows of
    every real slot (other rows are left unwritten). gate_up: a tile is gate rows j.. and up
    rows I + j.. (N = 2I)."""
    n_w = w.shape[1]
    half_off, tile_stride, tiles = (
        (n_w // 2, 64, n_w // 128) if gate_up else (64, TILE_ROWS, n_w // TILE_ROWS)
    )
    out = torch.empty(split, xg.shape[0], n_w, dtype=torch.float32, device=xg.device)
    w_desc, s_desc = weight_descriptors(w, s)
    x_dtype = gl.float8e4nv if decode == "fp8" else gl.bfloat16
    x_layout = gl.NVMMASharedLayout.get_default_for([block_t, SUB_K], x_dtype)
    x_desc = TensorDescriptor.from_tensor(xg, [block_t, SUB_K], x_layout)
    xs_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xs_block = [block_t, STEP_K // FP8_BLOCK] if decode == "fp8" else [1, 4]
    xs_desc = TensorDescriptor.from_tensor(xs, xs_block, xs_layout)
    grid = (min(num_sms(xg.device), p.slots * split * tiles),)
    _fp4_gemm_kernel[grid](
        w_desc, s_desc, x_desc, xs_desc, out, p.table, p.nslot,
        n_w, half_off, tile_stride, xg.shape[1] // split, out.stride(0), out.stride(1),
        NT=tiles, SPLITS=split, BT=block_t, STAGES=stages,
        DECODE=DECODES.index(decode), num_warps=4, maxnreg=168,
    )  # fmt: skip
    return out
