"""The row side of kernels.hopper.fp4_moe (plain Triton, so the CPU tests run it under the
interpreter): the routing plan (rows grouped by expert, the slot table the GEMMs walk), the
gathered and act_quant-ed activations in the GEMM's MMA column order, SwiGLU with the routing
weight and w2's act_quant, and the finish (each token's rows rounded to bf16 and added).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import quantize_rows, round_bf16
from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.fp4_moe import route_rows
from dsaserve.kernels.hopper.fp4_decode import DECODES, mma_order_block
from dsaserve.kernels.quant import FP8_BLOCK

SMALL_ROUTE = 2048  # rows up to which one program groups them by expert (a decode step)


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
def _store_slots(
    block_end_ptr, row_end_ptr, table_ptr, s, S, E,
    E_POW2: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    e, row0, end = _slot_rows(block_end_ptr, row_end_ptr, s, E, E_POW2, BT)
    ok = s < S
    tl.store(table_ptr + 3 * s, e, mask=ok)
    tl.store(table_ptr + 3 * s + 1, row0, mask=ok)
    tl.store(table_ptr + 3 * s + 2, end, mask=ok)


@triton.jit
def _slot_table_kernel(
    block_end_ptr, row_end_ptr, table_ptr, nslot_ptr, E, S,
    E_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """table[s] = (expert, first sorted row, end of the expert's rows) for every slot s < S;
    nslot = the number of real slots."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    _store_slots(block_end_ptr, row_end_ptr, table_ptr, s, S, E, E_POW2, BT)
    if tl.program_id(0) == 0:
        tl.store(nslot_ptr, tl.load(block_end_ptr + E - 1))


@triton.jit
def _route_kernel(
    ids_ptr, order_ptr, inv_ptr, row_end_ptr, block_end_ptr, table_ptr, nslot_ptr,
    R, E, S, R_POW2: tl.constexpr, E_BINS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_S: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
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
        _store_slots(
            block_end_ptr, row_end_ptr, table_ptr, s0 + tl.arange(0, BLOCK_S), S, E, E_POW2, BT
        )
    tl.store(nslot_ptr, tl.load(block_end_ptr + E - 1))


@triton.jit
def _store_activations(
    val, bits, scale, rows, ok, cols, xg_ptr, xs_ptr, stride_g, stride_s,
    BLOCK_M: tl.constexpr, DECODE: tl.constexpr,
):  # fmt: skip
    """One act_quant group [BLOCK_M, 128] (its codes' values, codes and scales) into the GEMM's
    activation buffer in MMA column order: dequantized bf16, or ("fp8") the codes and the
    scale times 2^6 (the weights' codes are 2^-6 times e2m1)."""
    dest = xg_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :]
    if DECODE == 2:
        tl.store(dest, mma_order_block(bits, BLOCK_M, DECODE), mask=ok[:, None])
        tl.store(xs_ptr + rows.to(tl.int64) * stride_s + tl.program_id(1), scale * 64.0, mask=ok)
    else:
        deq = mma_order_block(val.to(tl.float32) * scale[:, None], BLOCK_M, DECODE)
        tl.store(dest, deq.to(tl.bfloat16), mask=ok[:, None])


@triton.jit
def _gather_quant_kernel(
    x_ptr, order_ptr, xg_ptr, xs_ptr, R, TOPK, stride_x, stride_g, stride_s,
    BLOCK_M: tl.constexpr, DECODE: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """xg[r] = the release's act_quant of x[token of sorted row r] (_store_activations); one
    128-wide group of k a program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < R
    tok = (tl.load(order_ptr + rows, mask=ok, other=0) // TOPK).to(tl.int64)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=ok[:, None], other=0.0)
    val, bits, scale, _ = quantize_rows(x.to(tl.float32), INTERP)
    _store_activations(
        val, bits, scale, rows, ok, cols, xg_ptr, xs_ptr, stride_g, stride_s, BLOCK_M, DECODE
    )


@triton.jit
def _swiglu_kernel(
    part_ptr, order_ptr, rw_ptr, row_end_ptr, hg_ptr, hs_ptr, E, INTER, limit,
    stride_ps, stride_pr, stride_h, stride_hs,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DECODE: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Gate/up fp32 sums (added over K slices in order) -> h as the release computes it
    (bf16 gate and up, clamped SwiGLU, routing weight, bf16, act_quant per 128), stored for
    the down GEMM (_store_activations)."""
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
    val, bits, scale, _ = quantize_rows(h, INTERP)
    _store_activations(
        val, bits, scale, rows, ok, cols, hg_ptr, hs_ptr, stride_h, stride_hs, BLOCK_M, DECODE
    )


@triton.jit
def _finish_kernel(
    part_ptr, inv_ptr, row_end_ptr, y_ptr, T, E,
    stride_ps, stride_pr, stride_y,
    TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
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
    tl.store(
        y_ptr + tok[:, None].to(tl.int64) * stride_y + cols[None, :], y, mask=(tok < T)[:, None]
    )


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
        _route_kernel[(1,)](
            expert_ids.reshape(-1), scratch, inv, row_end, block_end, table, nslot,
            rows, n_exp, slots, R_POW2=triton.next_power_of_2(rows), E_BINS=bins, E_POW2=e_pow2,
            BLOCK_S=16, BT=block_t, num_warps=8,
        )  # fmt: skip
        return MoePlan(scratch[:rows], inv, row_end[:n_exp], table, nslot, slots)
    order, row_end, block_end, _ = route_rows(expert_ids, n_exp, block_t)
    inv = torch.empty_like(order)
    inv[order.long()] = torch.arange(rows, dtype=torch.int32, device=dev)
    _slot_table_kernel[(triton.cdiv(slots, 16),)](
        block_end, row_end, table, nslot, n_exp, slots,
        E_POW2=e_pow2, BLOCK_S=16, BT=block_t, num_warps=4,
    )  # fmt: skip
    return MoePlan(order, inv, row_end, table, nslot, slots)


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32


def activation_buffers(
    rows: int, k: int, decode: str, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM's activations [R, K] in MMA order (bf16, or e4m3 codes) and, for "fp8", their
    scales [R, K/128] fp32 (times 2^6); a one-element placeholder otherwise."""
    if decode == "fp8":
        return (
            torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(rows, k // FP8_BLOCK, dtype=torch.float32, device=dev),
        )
    return torch.empty(rows, k, dtype=torch.bfloat16, device=dev), torch.empty(1, 4, device=dev)


def gather_activations(
    x: torch.Tensor, p: MoePlan, topk: int, decode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> each sorted row's token, act_quant-ed per 128 (activation_buffers)."""
    rows, hidden = p.order.numel(), x.shape[1]
    xg, xs = activation_buffers(rows, hidden, decode, x.device)
    _gather_quant_kernel[(triton.cdiv(rows, _block_m(rows)), hidden // FP8_BLOCK)](
        x, p.order, xg.view(torch.uint8) if decode == "fp8" else xg, xs, rows, topk,
        x.stride(0), xg.stride(0), xs.stride(0), BLOCK_M=_block_m(rows),
        DECODE=DECODES.index(decode), INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip
    return xg, xs


def swiglu(
    part: torch.Tensor, p: MoePlan, route_w: torch.Tensor, swiglu_limit: float, decode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate/up sums part [split, R, 2I] fp32 -> w2's activations [R, I] (activation_buffers)."""
    split, rows, two_i = part.shape
    inter = two_i // 2
    hg, hs = activation_buffers(rows, inter, decode, part.device)
    _swiglu_kernel[(triton.cdiv(rows, _block_m(rows)), inter // FP8_BLOCK)](
        part, p.order, route_w, p.row_end, hg.view(torch.uint8) if decode == "fp8" else hg, hs,
        p.row_end.numel(), inter, float(swiglu_limit),
        part.stride(0), part.stride(1), hg.stride(0), hs.stride(0),
        SPLITS=split, BLOCK_M=_block_m(rows), HAS_LIMIT=swiglu_limit > 0,
        DECODE=DECODES.index(decode), INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip
    return hg, hs


def finish(part: torch.Tensor, p: MoePlan, tokens: int, topk: int) -> torch.Tensor:
    """Down sums part [split, R, H] fp32 -> [T, H] fp32: each (token, slot) row rounded to bf16
    as the release's expert output, the token's k rows added in fp32."""
    split, _, hidden = part.shape
    y = torch.empty(tokens, hidden, dtype=torch.float32, device=part.device)
    block_t = 16 if tokens <= 16 else 32
    _finish_kernel[(triton.cdiv(tokens, block_t), hidden // FP8_BLOCK)](
        part, p.inv, p.row_end, y, tokens, p.row_end.numel(),
        part.stride(0), part.stride(1), y.stride(0),
        TOPK=topk, SPLITS=split, BLOCK_T=block_t, INTERP=INTERPRET, num_warps=4,
    )  # fmt: skip
    return y
