"""Routed FP4 experts on Hopper (Gluon): kernels.fp4_moe's grouped GEMMs with the weight stream
behind TMA and the tensor cores fed from registers.

    y = fp4_moe_hopper(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)

Same contract, layouts and arithmetic as ``kernels.fp4_moe.fp4_moe`` (its docstring has them);
H and I multiples of 512 (``supported``). Why a second kernel: the Triton one decodes nibbles
between load and dot, which keeps Triton's pipeliner from overlapping the weight loads, so each
program waits on its loads (about a quarter of the H200's copy rate at decode).

One GEMM, used twice (gate/up, then down), swaps A and B: the weights are the MMA's M side
(128 rows a work item: two halves of 64, gate rows j and up rows I + j, or 128 consecutive rows
of w2), a slot's <= BT sorted token rows its N side. A persistent CTA walks its work items
(slot, K slice, 128-row tile) as one flat sequence of 512-wide K steps. Three partitions: a
producer warp keeps a TMA ring STAGES deep (each stage: the step's packed weights, scales and
activation tile, on one mbarrier) running ahead across item boundaries, and two consumer
warpgroups, one per 64-row half, each on its own: it loads its packed bytes from shared memory,
decodes them to bf16 with the 32-group's ue8m0 scale multiplied in (bf16 x power of two:
exact), hands them to ``warpgroup_mma`` as its register A operand (decoding the second half of
the step while the first MMA runs), and releases the stage. B is the activation tile,
dequantized bf16 (e4m3 code x ue8m0 scale: exact). Every product is exact and sums in fp32, as
the release's fp4_gemm; only the order of fp32 additions differs.

Two decodes (``HopperMoeConfig.decode``):
- "table": ``gl.fp4_to_fp`` (a byte-permute lookup) then a bf16 multiply; any scale.
- "shift": inline PTX, per 32-bit word of 8 codes: each pair of codes (n_o, n_o+4) is shifted
  into a bf16x2 whose value is 2^-126 times the e2m1 pair (e2m1's subnormal 0.5 lands on bf16's
  subnormals), then one bf16x2 multiply by 2^(s - 1). About 40% fewer instructions; the
  multiplier must be a bf16, so every weight scale byte must be <= 128 (scales <= 2): true of
  the release's weights, checked where they are loaded (``kernels.quant.narrow_fp4_scales``).

K order inside each 32-group: the register layout that lets a thread read 4 packed bytes at
once and give the decoded values to the MMA without moving data between threads puts input k
at another MMA position (``mma_columns``: a permutation of the 32 positions, so the scale group
of a value never changes); the activations are written in that order.

Launches: the routing plan (one program for a decode step's rows, else torch's sort and a slot
table), the gathered and quantized activations, the gate/up GEMM (fp32 sums per K slice),
SwiGLU + routing weight + w2's act_quant, the down GEMM, and the finish (each token's rows
rounded to bf16 and added). Nothing is read back to the host: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
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

from kernels.act_quant import quantize_rows, round_bf16
from kernels.env import INTERPRET, num_sms
from kernels.fp4_moe import check_experts, route_rows
from kernels.quant import FP8_BLOCK

STEP_K = 512  # K per pipeline stage (its 16 scale bytes per row are TMA's minimum box width)
SUB_K = 256  # K per decode + MMA sub-step (two per stage)
TILE_ROWS = 128  # weight rows per work item: two halves of 64, one per consumer warpgroup
SMEM_BUDGET = 220 * 1024  # of the H200's 227 KB per block
SMALL_ROUTE = 2048  # rows up to which one program groups them by expert (a decode step)
DECODES = ("table", "shift")
_STEP_K = gl.constexpr(STEP_K)  # the same, for the kernels
_SUB_K = gl.constexpr(SUB_K)


@dataclass(frozen=True)
class HopperMoeConfig:
    block_t: int  # BT: sorted token rows per slot (the MMA's N: 8, 16, 32 or 64)
    stages: int  # TMA ring depth
    split_k: tuple[int, int]  # K slices of (gate/up, down); fp32 partial sums added after
    decode: str = "table"  # "table" (any scale) or "shift" (scale bytes <= 128), see above


def stage_bytes(block_t: int) -> int:
    """Shared memory of one ring stage: packed weights, activations, scales."""
    return TILE_ROWS * STEP_K // 2 + block_t * STEP_K * 2 + TILE_ROWS * STEP_K // 32


def _split_for(items: int, k: int, sms: int) -> int:
    """K slices that bring `items` work items to about four per SM (slices >= STEP_K wide)."""
    split = 1
    while items * split < 4 * sms and k % (2 * split * STEP_K) == 0:
        split *= 2
    return split


def default_config(
    rows: int, experts: int, hidden: int, inter: int, sms: int, narrow_scales: bool = False
) -> HopperMoeConfig:
    """Shape-only choice; rows = T * k. narrow_scales: every weight scale byte is <= 128."""
    per_expert = rows / max(min(experts, rows), 1)
    block_t = 8 if per_expert <= 8 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    slots = triton.cdiv(rows, block_t) + min(experts, rows)
    busy = min(slots, min(experts, rows) + rows // block_t)  # slots a typical routing fills
    split = (
        _split_for(busy * (inter // 64), hidden, sms),
        _split_for(busy * (hidden // TILE_ROWS), inter, sms),
    )
    stages = max(2, min(6, SMEM_BUDGET // stage_bytes(block_t)))
    return HopperMoeConfig(block_t, stages, split, "shift" if narrow_scales else "table")


def supported(hidden: int, inter: int) -> bool:
    """Shapes the Gluon kernels take (others run kernels.fp4_moe)."""
    return hidden % STEP_K == 0 and inter % STEP_K == 0


def mma_columns(k: int, decode: str) -> torch.Tensor:
    """[k]: the input index whose value sits at each MMA column (K position) of a decode."""
    c = torch.arange(k)
    base, b0, d1, d3 = c & ~31, c & 1, (c >> 1) & 3, (c >> 3) & 3
    if decode == "table":  # c = b0 + 2 d1 + 8 d3 holds input b0 + 8 d1 + 2 d3
        return base | b0 | (d1 << 3) | (d3 << 1)
    # "shift": c = e + 2 t + 8 o holds code o + 4 e of word t: input 8 t + 4 e + o
    return base | (d1 << 3) | (b0 << 2) | d3


def to_mma_order(x: torch.Tensor, decode: str) -> torch.Tensor:
    """[..., K] in input order -> MMA column order (as the kernels write activations)."""
    return x[..., mma_columns(x.shape[-1], decode).to(x.device)]


@triton.jit
def _to_mma_order(x, BM: tl.constexpr, DECODE: tl.constexpr):
    """[BM, 128] values in input order -> the same in MMA column order (mma_columns)."""
    if DECODE == 0:  # digits (group, d3, d1, b0) of the input index -> (group, d1, d3, b0)
        y = tl.permute(tl.reshape(x, [BM, 4, 4, 4, 2]), (0, 1, 3, 2, 4))
    else:  # input (group, t, e, o) -> column (group, o, t, e)
        y = tl.permute(tl.reshape(x, [BM, 4, 4, 2, 4]), (0, 1, 4, 2, 3))
    return tl.reshape(y, [BM, 128])


# ---------------------------------------------------------------- the grouped GEMM (Gluon)


@gluon.constexpr_function
def _packed_layout():
    """[64 rows, 128 bytes] of packed e2m1 (one SUB_K step of a warpgroup's half): a thread
    holds 4 consecutive bytes (one 32-bit shared load) of words w = 4m + t, t = lane % 4, for
    rows g and g + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [0, 64], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 128],
    )


@gluon.constexpr_function
def _group_layout():
    """Decoded values [64 rows, 8 groups, 32 k] as fp4_to_fp lays them out from _packed_layout:
    k = nibble + 2 * byte + 8 * t within a group."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0], [8, 0, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 8, 32],
    )


@gluon.constexpr_function
def _word_layout():
    """The same bytes as [64 rows, 8 groups, 4 words (t), 2 halves] of int16: a word's two
    halves in one register."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
        block_bases=[],
        shape=[64, 8, 4, 2],
    )


@gluon.jit
def _decode_table(w_tile, s_tile, A_LAYOUT: gl.constexpr):
    """Shared [64, 128] packed bytes, [64, 8] scale bytes -> A [64, 256] bf16 in MMA order."""
    sb = s_tile.load(gl.SliceLayout(2, _group_layout())).to(gl.int16)
    bits = gl.where(sb == 0, 0x40, sb << 7)  # 2^(b - 127) as bf16; byte 0 is 2^-127
    scale = gl.where(sb == 255, 0x7FC0, bits).to(gl.bfloat16, bitcast=True)
    w = gl.fp4_to_fp(w_tile.load(_packed_layout()), gl.bfloat16, axis=1)  # [64, 256] input order
    w = gl.convert_layout(gl.reshape(w, [64, 8, 32]), _group_layout(), assert_trivial=True)
    w = w * gl.expand_dims(scale, 2)
    w = gl.reshape(gl.permute(gl.reshape(w, [64, 8, 4, 4, 2]), (0, 1, 3, 2, 4)), [64, 256])
    return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _decode_shift(w_tile, s_tile, A_LAYOUT: gl.constexpr):
    """As _decode_table with the "shift" decode (scale bytes <= 128)."""
    L4: gl.constexpr = _word_layout()
    sb = s_tile.load(gl.SliceLayout(2, gl.SliceLayout(3, L4))).to(gl.int16)  # [64, 8]
    mult = (sb + 126) << 7  # bf16 2^(b - 1): undoes the decode's 2^-126
    mult = gl.expand_dims(gl.expand_dims(mult, 2), 3)  # [64, 8, 1, 1]
    as16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    words = w_tile._reinterpret(gl.int16, [64, 64], as16).load(
        gl.DistributedLinearLayout(  # the [64, 8, 4, 2] word layout, flattened
            reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [8, 0]],
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 64],
        )
    )
    words = gl.convert_layout(gl.reshape(words, [64, 8, 4, 2]), L4, assert_trivial=True)
    words, mult = gl.broadcast(words, mult)
    # out_o = codes (o, o + 4) of the word as bf16x2, times the scale
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 q, t, u;
        shl.b32 q, $4, 12;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $0, t, $5;
        shl.b32 q, $4, 8;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $1, t, $5;
        shl.b32 q, $4, 4;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $2, t, $5;
        and.b32 t, $4, 0x80008000;
        shr.b32 u, $4, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $3, t, $5;
        }
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[words, mult],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=2,
    )
    # [64, 8 (group), 4 (t), 2 (e), 2 (i), 2 (j)], o = i + 2 j -> columns e + 2 t + 8 o + 32 group
    w = gl.join(gl.join(o0, o1), gl.join(o2, o3))
    w = gl.permute(w, (0, 1, 5, 4, 2, 3))
    return gl.convert_layout(gl.reshape(w, [64, 256]), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _item_of(step, pid, nprog, ksteps, NT: gl.constexpr, SPLITS: gl.constexpr):
    """Flat step of this CTA -> (slot, K slice, row tile, K step within the item)."""
    item = pid + (step // ksteps) * nprog
    slot = item // (SPLITS * NT)
    rem = item % (SPLITS * NT)
    return slot, rem // NT, rem % NT, step % ksteps


# fmt: off
@gluon.jit
def _producer(w_desc, s_desc, x_desc, w_smem, s_smem, x_smem, ready, empty, slot_ptr,
              pid, nprog, ksteps, total, n_w, half_off, tile_stride, k_item,
              NT: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr):
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
        mbarrier.expect(bar, 4 * w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
                        + 2 * s_desc.block_type.nbytes)
        for h in gl.static_range(2):
            w_buf = w_smem.index(2 * s + h)
            tma.async_copy_global_to_shared(w_desc, [wrow, k // 2 + h * _SUB_K // 2], bar,
                                            w_buf.slice(0, 64))
            tma.async_copy_global_to_shared(w_desc, [wrow + half_off, k // 2 + h * _SUB_K // 2],
                                            bar, w_buf.slice(64, 64))
            tma.async_copy_global_to_shared(x_desc, [row0, k + h * _SUB_K], bar,
                                            x_smem.index(2 * s + h))
        s_buf = s_smem.index(s)
        tma.async_copy_global_to_shared(s_desc, [wrow, k // 32], bar, s_buf.slice(0, 64))
        tma.async_copy_global_to_shared(s_desc, [wrow + half_off, k // 32], bar,
                                        s_buf.slice(64, 64))


@gluon.jit
def _consumer(w_smem, s_smem, x_smem, ready, empty, out_ptr, slot_ptr,
              pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
              HALF: gl.constexpr, NT: gl.constexpr, SPLITS: gl.constexpr,
              STAGES: gl.constexpr, BT: gl.constexpr, DECODE: gl.constexpr):
    """One warpgroup, rows [64 HALF, 64 HALF + 64) of each tile: decode each stage's weights
    into registers, MMA against its activation tile, release the stage; at an item's last
    step store its fp32 sums."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BT, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
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
        if DECODE == 0:
            a0 = _decode_table(w0, s_half.slice(0, 8, dim=1), A_LAYOUT)
        else:
            a0 = _decode_shift(w0, s_half.slice(0, 8, dim=1), A_LAYOUT)
        acc = warpgroup_mma(a0, x_smem.index(2 * s).permute((1, 0)), acc, use_acc=kk > 0,
                            is_async=True)
        if DECODE == 0:  # the second half decodes while the first MMA runs
            a1 = _decode_table(w1, s_half.slice(8, 8, dim=1), A_LAYOUT)
        else:
            a1 = _decode_shift(w1, s_half.slice(8, 8, dim=1), A_LAYOUT)
        acc = warpgroup_mma(a1, x_smem.index(2 * s + 1).permute((1, 0)), acc, is_async=True)
        acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))
        gl.thread_barrier()  # every warp of this group is done with stage s ...
        fence_async_shared()  # ... and its reads are ordered before the TMA that refills it
        mbarrier.arrive(empty.index(s), count=1)
        if kk == ksteps - 1:
            srow = row0 + cols
            ptr = (out_ptr + split.to(gl.int64) * stride_os
                   + srow[None, :].to(gl.int64) * stride_or
                   + (nt * tile_stride + HALF * half_off + rows)[:, None])
            gl.store(ptr, acc, mask=(srow < row_end)[None, :])


@gluon.jit
def _fp4_gemm_kernel(w_desc, s_desc, x_desc, out_ptr, slot_ptr, nslot_ptr,
                     n_w, half_off, tile_stride, k_item, stride_os, stride_or,
                     NT: gl.constexpr, SPLITS: gl.constexpr, BT: gl.constexpr,
                     STAGES: gl.constexpr, DECODE: gl.constexpr, num_warps: gl.constexpr):
    """out[split, sorted row, weight row] = sum over the split's K of w[e, row, k] x[row, k]
    for every real slot (slot_ptr: int32 [S, 3] expert, first row, end of the expert's rows;
    nslot_ptr: the number of real slots). Weight rows of a tile: tile_stride * nt + [0, 64) and
    half_off + tile_stride * nt + [0, 64). Persistent: CTA pid takes items pid, pid + nprog, ..."""
    gl.static_assert(num_warps == 4)
    w_smem = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 128, _SUB_K // 2], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BT, _SUB_K], x_desc.layout)
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

    gl.warp_specialize([
        (_consumer, (w_smem, s_smem, x_smem, ready, empty, out_ptr, slot_ptr,
                     pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
                     0, NT, SPLITS, STAGES, BT, DECODE)),
        (_consumer, (w_smem, s_smem, x_smem, ready, empty, out_ptr, slot_ptr,
                     pid, nprog, ksteps, total, half_off, tile_stride, stride_os, stride_or,
                     1, NT, SPLITS, STAGES, BT, DECODE)),
        (_producer, (w_desc, s_desc, x_desc, w_smem, s_smem, x_smem, ready, empty, slot_ptr,
                     pid, nprog, ksteps, total, n_w, half_off, tile_stride, k_item,
                     NT, SPLITS, STAGES)),
    ], [4, 1], [168, 40])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# ---------------------------------------------------------------- plan, prologue, epilogues


@triton.jit
def _slot_rows(block_end_ptr, row_end_ptr, s, E, E_POW2: tl.constexpr, BT: tl.constexpr):
    """Slots s [BLOCK] -> (expert (E past the last block), first sorted row, end of the
    expert's rows), from the per-expert inclusive cumsums of blocks and rows."""
    idx = tl.arange(0, E_POW2)
    block_end = tl.load(block_end_ptr + idx, mask=idx < E, other=2147483647)
    row_end = tl.load(row_end_ptr + idx, mask=idx < E, other=0)
    before = block_end[None, :] <= s[:, None]  # [BLOCK, E_POW2]
    e = tl.sum(before.to(tl.int32), axis=1)  # the first e with block_end[e] > s
    first_block = tl.max(tl.where(before, block_end[None, :], 0), axis=1)
    row_start = tl.max(tl.where(before, row_end[None, :], 0), axis=1)
    mine = idx[None, :] == tl.minimum(e, E - 1)[:, None]
    end = tl.sum(tl.where(mine, row_end[None, :], 0), axis=1)
    return e, row_start + (s - first_block) * BT, end


@triton.jit
def _store_slots(block_end_ptr, row_end_ptr, table_ptr, s, S, E,
                 E_POW2: tl.constexpr, BT: tl.constexpr):
    e, row0, end = _slot_rows(block_end_ptr, row_end_ptr, s, E, E_POW2, BT)
    ok = s < S
    tl.store(table_ptr + 3 * s, e, mask=ok)
    tl.store(table_ptr + 3 * s + 1, row0, mask=ok)
    tl.store(table_ptr + 3 * s + 2, end, mask=ok)


@triton.jit
def _slot_table_kernel(block_end_ptr, row_end_ptr, table_ptr, nslot_ptr, E, S,
                       E_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BT: tl.constexpr):
    """table[s] = (expert, first sorted row, end of the expert's rows) for every slot s < S;
    nslot = the number of real slots."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    _store_slots(block_end_ptr, row_end_ptr, table_ptr, s, S, E, E_POW2, BT)
    if tl.program_id(0) == 0:
        tl.store(nslot_ptr, tl.load(block_end_ptr + E - 1))


@triton.jit
def _route_kernel(ids_ptr, order_ptr, inv_ptr, row_end_ptr, block_end_ptr, table_ptr, nslot_ptr,
                  R, E, S, R_POW2: tl.constexpr, E_BINS: tl.constexpr, E_POW2: tl.constexpr,
                  BLOCK_S: tl.constexpr, BT: tl.constexpr):
    """A decode step's whole routing plan in one program: the rows grouped by expert (order, and
    its inverse), the per-expert cumsums, and the slot table. Ids outside [0, E) go last. Rows
    of one expert come in the order their atomics land: each row's sums are its own, so the
    order changes no result."""
    r = tl.arange(0, R_POW2)
    ok = r < R
    e_r = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int32)
    e_r = tl.where((e_r >= 0) & (e_r < E), e_r, E)
    counts = tl.histogram(e_r, E_BINS, mask=ok)  # bin E: other ranks' experts
    eidx = tl.arange(0, E_BINS)
    row_end = tl.cumsum(counts, 0)
    tl.store(row_end_ptr + eidx, row_end)
    tl.store(block_end_ptr + eidx, tl.cumsum((counts + BT - 1) // BT * (eidx < E), 0))
    tl.store(order_ptr + R + eidx, 0)  # order[R:] is scratch: a rank counter per bin
    tl.debug_barrier()  # the cumsums and counters are read back by other threads of the program
    start = tl.load(row_end_ptr + e_r - 1, mask=ok & (e_r > 0), other=0)
    rank = tl.atomic_add(order_ptr + R + e_r, 1, mask=ok)
    tl.debug_barrier()
    pos = start + rank
    tl.store(order_ptr + pos, r, mask=ok)
    tl.store(inv_ptr + r, pos, mask=ok)
    for s0 in range(0, S, BLOCK_S):
        _store_slots(block_end_ptr, row_end_ptr, table_ptr, s0 + tl.arange(0, BLOCK_S), S, E,
                     E_POW2, BT)
    tl.store(nslot_ptr, tl.load(block_end_ptr + E - 1))


@triton.jit
def _gather_quant_kernel(x_ptr, order_ptr, xg_ptr, R, TOPK, stride_x, stride_g,
                         BLOCK_M: tl.constexpr, DECODE: tl.constexpr, INTERP: tl.constexpr):
    """xg[r] = the release's act_quant of x[token of sorted row r], dequantized (bf16, exact),
    in MMA column order; one 128-wide group of k a program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < R
    tok = (tl.load(order_ptr + rows, mask=ok, other=0) // TOPK).to(tl.int64)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=ok[:, None], other=0.0)
    val, _, scale, _ = quantize_rows(x.to(tl.float32), INTERP)
    deq = _to_mma_order(val.to(tl.float32) * scale[:, None], BLOCK_M, DECODE)
    tl.store(xg_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :], deq.to(tl.bfloat16),
             mask=ok[:, None])


@triton.jit
def _swiglu_kernel(part_ptr, order_ptr, rw_ptr, row_end_ptr, hg_ptr, E, INTER, limit,
                   stride_ps, stride_pr, stride_h,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   DECODE: tl.constexpr, INTERP: tl.constexpr):
    """Gate/up fp32 sums (added over K slices in order) -> h as the release computes it
    (bf16 gate and up, clamped SwiGLU, routing weight, bf16, act_quant per 128), dequantized
    in MMA column order for the down GEMM."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < tl.load(row_end_ptr + E - 1)  # rows of this rank's experts
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    part = part_ptr + rows[:, None].to(tl.int64) * stride_pr + cols[None, :]
    gate = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        gate += tl.load(part + sp * stride_ps, mask=ok[:, None], other=0.0)
        up += tl.load(part + sp * stride_ps + INTER, mask=ok[:, None], other=0.0)
    gate = round_bf16(gate, INTERP)
    up = round_bf16(up, INTERP)
    if HAS_LIMIT:
        up = tl.clamp(up, -limit, limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    flat = tl.load(order_ptr + rows, mask=ok, other=0)
    h = round_bf16(tl.load(rw_ptr + flat, mask=ok, other=0.0)[:, None] * h, INTERP)
    val, _, scale, _ = quantize_rows(h, INTERP)
    deq = _to_mma_order(val.to(tl.float32) * scale[:, None], BLOCK_M, DECODE)
    tl.store(hg_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], deq.to(tl.bfloat16),
             mask=ok[:, None])


@triton.jit
def _finish_kernel(part_ptr, inv_ptr, row_end_ptr, y_ptr, T, E,
                   stride_ps, stride_pr, stride_y,
                   TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                   INTERP: tl.constexpr):
    """y[t] = sum over the token's k rows of bf16(its down sum over K slices in order), in fp32;
    rows of other ranks' experts (sorted past this rank's) add nothing."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    live = tl.load(row_end_ptr + E - 1)
    y = tl.zeros([BLOCK_T, 128], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pos = tl.load(inv_ptr + tok * TOPK + j, mask=tok < T, other=0)
        ok = (tok < T) & (pos < live)
        part = part_ptr + pos[:, None].to(tl.int64) * stride_pr + cols[None, :]
        acc = tl.zeros([BLOCK_T, 128], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            acc += tl.load(part + sp * stride_ps, mask=ok[:, None], other=0.0)
        y += round_bf16(acc, INTERP)  # the expert's output is bf16 in the release
    tl.store(y_ptr + tok[:, None].to(tl.int64) * stride_y + cols[None, :], y,
             mask=(tok < T)[:, None])
# fmt: on


# ---------------------------------------------------------------- host side


@dataclass
class MoePlan:
    """One call's row plan (all on the device)."""

    order: torch.Tensor  # [R] int32: (token, slot) rows sorted by expert
    inv: torch.Tensor  # [R] int32: each (token, slot) row's sorted position
    row_end: torch.Tensor  # [E] int32: inclusive cumsum of rows per expert
    table: torch.Tensor  # [S, 3] int32: per slot (expert, first sorted row, end of its rows)
    nslot: torch.Tensor  # [1] int32: slots in use
    slots: int  # S: the bound on slots any routing can need


def plan(expert_ids: torch.Tensor, n_exp: int, block_t: int) -> MoePlan:
    """Rows sorted by expert and the slot table of <= block_t-row slots the GEMMs walk: one
    program for up to SMALL_ROUTE rows, else torch's sort (kernels.fp4_moe.route_rows)."""
    dev = expert_ids.device
    rows = expert_ids.numel()
    slots = triton.cdiv(rows, block_t) + min(n_exp, rows)
    table = torch.empty(slots, 3, dtype=torch.int32, device=dev)
    nslot = torch.empty(1, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(n_exp)
    if rows <= SMALL_ROUTE:
        bins = triton.next_power_of_2(n_exp + 1)
        scratch = torch.empty(rows + bins, dtype=torch.int32, device=dev)  # order + counters
        inv = torch.empty(rows, dtype=torch.int32, device=dev)
        row_end = torch.empty(bins, dtype=torch.int32, device=dev)
        block_end = torch.empty(bins, dtype=torch.int32, device=dev)
        # fmt: off
        _route_kernel[(1,)](
            expert_ids.reshape(-1), scratch, inv, row_end, block_end, table, nslot,
            rows, n_exp, slots, R_POW2=triton.next_power_of_2(rows), E_BINS=bins, E_POW2=e_pow2,
            BLOCK_S=16, BT=block_t, num_warps=8,
        )
        # fmt: on
        return MoePlan(scratch[:rows], inv, row_end[:n_exp], table, nslot, slots)
    order, row_end, block_end, _ = route_rows(expert_ids, n_exp, block_t)
    inv = torch.empty_like(order)
    inv[order.long()] = torch.arange(rows, dtype=torch.int32, device=dev)
    # fmt: off
    _slot_table_kernel[(triton.cdiv(slots, 16),)](
        block_end, row_end, table, nslot, n_exp, slots,
        E_POW2=e_pow2, BLOCK_S=16, BT=block_t, num_warps=4,
    )
    # fmt: on
    return MoePlan(order, inv, row_end, table, nslot, slots)


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32


def gather_activations(x: torch.Tensor, p: MoePlan, topk: int, decode: str) -> torch.Tensor:
    """x [T, H] -> [R, H] bf16: each sorted row's token, act_quant-ed per 128 and dequantized,
    in MMA column order."""
    rows, hidden = p.order.numel(), x.shape[1]
    xg = torch.empty(rows, hidden, dtype=torch.bfloat16, device=x.device)
    # fmt: off
    _gather_quant_kernel[(triton.cdiv(rows, _block_m(rows)), hidden // FP8_BLOCK)](
        x, p.order, xg, rows, topk, x.stride(0), xg.stride(0), BLOCK_M=_block_m(rows),
        DECODE=DECODES.index(decode), INTERP=INTERPRET, num_warps=4,
    )
    # fmt: on
    return xg


def swiglu(
    part: torch.Tensor, p: MoePlan, route_w: torch.Tensor, swiglu_limit: float, decode: str
) -> torch.Tensor:
    """Gate/up sums part [split, R, 2I] fp32 -> w2's activations [R, I] bf16, MMA order."""
    split, rows, two_i = part.shape
    inter = two_i // 2
    hg = torch.empty(rows, inter, dtype=torch.bfloat16, device=part.device)
    # fmt: off
    _swiglu_kernel[(triton.cdiv(rows, _block_m(rows)), inter // FP8_BLOCK)](
        part, p.order, route_w, p.row_end, hg, p.row_end.numel(), inter, float(swiglu_limit),
        part.stride(0), part.stride(1), hg.stride(0),
        SPLITS=split, BLOCK_M=_block_m(rows), HAS_LIMIT=swiglu_limit > 0,
        DECODE=DECODES.index(decode), INTERP=INTERPRET, num_warps=4,
    )
    # fmt: on
    return hg


def finish(part: torch.Tensor, p: MoePlan, tokens: int, topk: int) -> torch.Tensor:
    """Down sums part [split, R, H] fp32 -> [T, H] fp32: each (token, slot) row rounded to bf16
    as the release's expert output, the token's k rows added in fp32."""
    split, _, hidden = part.shape
    y = torch.empty(tokens, hidden, dtype=torch.float32, device=part.device)
    block_t = 16 if tokens <= 16 else 32
    # fmt: off
    _finish_kernel[(triton.cdiv(tokens, block_t), hidden // FP8_BLOCK)](
        part, p.inv, p.row_end, y, tokens, p.row_end.numel(),
        part.stride(0), part.stride(1), y.stride(0),
        TOPK=topk, SPLITS=split, BLOCK_T=block_t, INTERP=INTERPRET, num_warps=4,
    )
    # fmt: on
    return y


def _weight_descriptors(w: torch.Tensor, s: torch.Tensor) -> tuple[TensorDescriptor, ...]:
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
    p: MoePlan,
    *,
    gate_up: bool,
    split: int,
    cfg: HopperMoeConfig,
) -> torch.Tensor:
    """fp32 [split, R, N] sums over each K slice of w[e] (N rows, K/2 packed bytes, scales s)
    times the MMA-ordered activations xg [R, K], for the valid rows of every real slot (other
    rows are left unwritten). gate_up: a tile is gate rows j.. and up rows I + j.. (N = 2I)."""
    n_w = w.shape[1]
    half_off, tile_stride, tiles = (
        (n_w // 2, 64, n_w // 128) if gate_up else (64, TILE_ROWS, n_w // TILE_ROWS)
    )
    out = torch.empty(split, xg.shape[0], n_w, dtype=torch.float32, device=xg.device)
    w_desc, s_desc = _weight_descriptors(w, s)
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_t, SUB_K], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(xg, [cfg.block_t, SUB_K], x_layout)
    grid = (min(num_sms(xg.device), p.slots * split * tiles),)
    # fmt: off
    _fp4_gemm_kernel[grid](
        w_desc, s_desc, x_desc, out, p.table, p.nslot,
        n_w, half_off, tile_stride, xg.shape[1] // split, out.stride(0), out.stride(1),
        NT=tiles, SPLITS=split, BT=cfg.block_t, STAGES=cfg.stages,
        DECODE=DECODES.index(cfg.decode), num_warps=4, maxnreg=168,
    )
    # fmt: on
    return out


def fp4_moe_hopper(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
    *,
    config: HopperMoeConfig | None = None,
    narrow_scales: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed FP4 experts on an sm_90 device; contract of kernels.fp4_moe.fp4_moe.
    narrow_scales: the caller knows every weight scale byte is <= 128
    (``kernels.quant.narrow_fp4_scales``), which lets the default config pick the faster
    decode."""
    n_exp, hidden, inter = check_experts(w13, s13, w2, s2)
    if not supported(hidden, inter):
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of {STEP_K}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} vs experts of hidden size {hidden}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} vs x {tuple(x.shape)}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} vs expert_ids {tuple(expert_ids.shape)}")
    tokens, topk = expert_ids.shape
    if tokens * topk == 0:
        return torch.zeros(tokens, hidden, dtype=out_dtype, device=x.device)
    cfg = config or default_config(
        tokens * topk, n_exp, hidden, inter, num_sms(x.device), narrow_scales
    )
    split_up, split_down = cfg.split_k
    if hidden % (split_up * STEP_K) or inter % (split_down * STEP_K) or cfg.decode not in DECODES:
        raise ValueError(f"unsupported config {cfg} for hidden {hidden}, intermediate {inter}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = plan(expert_ids, n_exp, cfg.block_t)
    xg = gather_activations(x, p, topk, cfg.decode)
    up = grouped_gemm(w13.view(torch.uint8), s13, xg, p, gate_up=True, split=split_up, cfg=cfg)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    hg = swiglu(up, p, route_w, swiglu_limit, cfg.decode)
    down = grouped_gemm(w2.view(torch.uint8), s2, hg, p, gate_up=False, split=split_down, cfg=cfg)
    return finish(down, p, tokens, topk).to(out_dtype)
