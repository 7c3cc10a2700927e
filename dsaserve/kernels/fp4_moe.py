"""Routed experts with FP4 weights (Triton): the release's MoE expert loop as two grouped GEMMs.

    y = fp4_moe(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)

    x           [T, H] bf16 (fp16/fp32 accepted)
    expert_ids  [T, k] int32/int64; weights [T, k] fp32 (the gate's, route scale applied)
    w13         [E, 2I, H/2] int8: two e2m1 codes per byte, low nibble first; rows 0..I-1 are the
                expert's w1 (gate), rows I..2I-1 its w3 (up), each exactly as in the checkpoint
    s13         [E, 2I, H/32] float8_e8m0fnu: one scale per 32 inputs
    w2          [E, H, I/2] int8, s2 [E, H, I/32] float8_e8m0fnu
    -> y        [T, H] fp32 (out_dtype): sum over the token's experts of their bf16 outputs;
                ids outside [0, E) add nothing (expert parallelism: other ranks hold them)

H and I multiples of 128. ``stack_fp4_experts`` builds this layout from per-expert checkpoint
tensors (``layers.N.ffn.experts.E.w{1,2,3}.{weight,scale}``); the engine's loader stacks them once.

Arithmetic, as the release (inference/model.py Expert.forward, linear(), kernel.py fp4_gemm;
reference: kernels.quant.fp4_experts_reference): x is quantized once per 128 values (act_quant: the
release quantizes before w1 and before w3, identically); gate and up are fp4_gemm outputs rounded
to bf16; h = silu(min(gate, L)) * clamp(up, -L, L) in fp32, times the routing weight (before w2,
unlike engine.layers.experts' bf16 path), rounded to bf16 and quantized per 128 again; the down
projection's bf16 outputs are added in fp32. Each fp4 GEMM promotes per 32-value chunk like
fp4_gemm_kernel: a tensor-core dot of the chunk (exact products, fp32 sums) into a fresh tile,
times w_scale, into an fp32 block sum that is scaled by x_scale (a power of two, so equal to
scaling each chunk) and added to the fp32 accumulator; only the order of fp32 additions differs
from the release.

The weights never leave FP4 in memory: a program loads packed bytes and turns each nibble into
the e4m3 code of 2^-6 times its e2m1 value with a few bit operations (kernels.act_quant
.fp4_to_e4m3, four bytes per instruction in inline PTX on the GPU; the 2^6 goes into the chunk's
scale). Both operands then go to the tensor cores as fp16, which holds every e4m3 value exactly
(for these row counts Triton's sm_90 path, mma.sync, upcasts fp8 to fp16 anyway), so every
product is exact as in fp4_gemm's fp4 -> fp32 -> fp8 cast and fp8 dot. The low nibbles (even k)
and the high ones (odd k) of a 32-value chunk are two K=16 dots against the even and the odd
activations: no interleave in registers.

Kernels:
1. act_quant of x.
2. gate/up: one program per (block of <= BLOCK_M rows of one expert, 128 intermediate columns)
   computes the gate and the up tile (weight rows j and I + j), applies the clamped SwiGLU and the
   routing weight, and quantizes h per 128 right there (it holds the whole 128-wide group).
3. down: one program per (row block, BLOCK_N output columns); bf16 rows land at the token's
   (token, slot) row; the k rows of a token are then summed in fp32.
Rows are sorted by expert (stable argsort, as engine.layers.experts.RoutedExperts) and each
expert's rows are cut into BLOCK_M blocks; the grid has ceil(T*k / BLOCK_M) + min(E, T*k) block
slots, a bound on the blocks any routing can need, and a program finds its expert by counting the
per-expert block ends at or below its slot, so nothing is read back to the host (CUDA-graph
capturable). Idle slots return at once. Few rows (a decode step of a token or two) leave most
SMs idle; the GEMMs then split K (MoeConfig.split_k, split_for) and a finishing pass adds the
slices. Decode (64 tokens, top-6, 256 experts: ~1.5 rows per expert) is bound by
reading the FP4 weights of the ~200 experts hit, 4x fewer bytes than bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import act_quant, fp4_to_e4m3, quantize_rows, round_bf16
from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.quant import FP4_BLOCK, FP8_BLOCK


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted rows per program, all of one expert (>= 16: tl.dot's minimum)
    block_n: int  # down-projection output columns per program
    num_warps: int
    num_stages: int
    use_asm: bool  # decode nibbles four bytes per instruction (inline PTX; GPU only)
    # K slices per GEMM (split-K: fp32 partial sums, added in slice order by a second pass):
    # (gate/up, down); (1, 1) computes each output tile in one program (see split_for)
    split_k: tuple[int, int] = (1, 1)


# Split-K, only for grids that cannot fill the GPU: a program streams its weight tile at a few
# GB/s (its loads wait on each other), so a decode step of one token (6 experts: 96 gate/up
# and 192 down tile programs) reads 80 MB in 210 us; 8 slices each take it to 150 us. From
# 4 tokens on (400 gate/up tiles) splitting is slower (measured on the H200, 256 experts,
# hidden 4096, intermediate 2048).
SPLIT_BELOW = 256  # tile programs: fewer than about two per SM
SPLIT_TARGET = 768
MAX_SPLIT = 8


def split_for(programs: int, k_blocks: int) -> int:
    """K slices for a GEMM of `programs` output tiles over `k_blocks` 128-wide K blocks: 1 when
    the tiles fill the GPU, else a power of two dividing k_blocks that brings them to about
    SPLIT_TARGET programs (at most MAX_SPLIT)."""
    split = 1
    while (
        programs < SPLIT_BELOW
        and programs * split < SPLIT_TARGET
        and split < MAX_SPLIT
        and k_blocks % (2 * split) == 0
    ):
        split *= 2
    return split


def default_config(
    rows: int, experts: int, device: torch.device, hidden: int = 4096, inter: int = 2048
) -> MoeConfig:
    """Shape-only choice. rows = T * k."""
    # Decode steps are bound by instruction issue as much as by HBM (sm_90 SASS, per KB of
    # weights and SM: ~60 issue cycles in the gate/up loop, ~68 in the down loop at BLOCK_N 128,
    # ~96 at 64; ~64 would keep up with 4 TB/s); the inline-PTX nibble decode halves them
    # against plain Triton. 64-row blocks spill (four [64, 128] fp32 tiles in the gate/up
    # program), so prefill uses 32 rows and 8 warps.
    block_m = 16 if rows <= 16 * max(experts, 1) else 32
    blocks = min(rows, experts) + rows // block_m  # row blocks a routing can need, about
    split = (
        split_for(blocks * (inter // 128), hidden // 128),
        split_for(blocks * triton.cdiv(hidden, 128), inter // 128),
    )
    return MoeConfig(block_m, 128, 4 if block_m == 16 else 8, 4, device.type == "cuda", split)


@triton.jit
def _chunk(
    acc, a_even, a_odd, b, scale_word, C: tl.constexpr, USE_ASM: tl.constexpr, INTERP: tl.constexpr
):
    """One 32-value chunk (number C of its 128-wide K block) as fp4_gemm's inner step, less the
    activation scale (one per block: the caller applies it to the block's sum, which equals
    applying it per chunk since it is a power of two): acc + (a . e2m1^T) * w_scale.

    a_even, a_odd [BM, 16]: the chunk's activations at even / odd k (fp16: exact for e4m3;
    fp32 under the interpreter). b [BN, 16]: packed weight bytes, byte j holding k = 2j (low
    nibble) and 2j + 1, so the low nibbles meet a_even and the high ones a_odd: no interleave.
    scale_word [BN] int32: the block's four ue8m0 weight-scale bytes, chunk C in byte C."""
    lo, hi = fp4_to_e4m3(b, USE_ASM)  # e4m3 codes of 2^-6 * e2m1, exact in fp16
    if INTERP:
        w_even = lo.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w_odd = hi.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        part = tl.dot(a_even, tl.trans(w_even), input_precision="ieee")
        part = tl.dot(a_odd, tl.trans(w_odd), acc=part, input_precision="ieee")
    else:  # fp16 operands, fp32 accumulation: every product exact, as fp8 x fp8
        w_even = lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        w_odd = hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        part = tl.dot(a_even, tl.trans(w_even))
        part = tl.dot(a_odd, tl.trans(w_odd), acc=part)
    # 2^(byte - 127) * 2^6 (undoing the codes' 2^-6): byte + 6 as an fp32 exponent field
    sw = ((((scale_word >> (8 * C)) & 0xFF) + 6) << 23).to(tl.float32, bitcast=True)
    return acc + part * sw[None, :]


@triton.jit
def _act_pair(a_ptrs, ok, INTERP: tl.constexpr):
    """fp8 activations at a_ptrs (even k) and a_ptrs + 1 (odd k) -> dot operands."""
    a_even = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
    a_odd = tl.load(a_ptrs + 1, mask=ok[:, None], other=0.0)
    if INTERP:
        return a_even.to(tl.float32), a_odd.to(tl.float32)
    else:
        return a_even.to(tl.float16), a_odd.to(tl.float16)


@triton.jit
def _act_scale(ptrs, ok):
    """ue8m0 bytes of act_quant's scales (2^-22 .. 2^120, never 0 or 255) -> fp32."""
    return (tl.load(ptrs, mask=ok, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def slot_rows(slot, block_end_ptr, row_end_ptr, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block slot -> (expert, first sorted row, end of the expert's rows); expert == E when the
    slot is past the last block. block_end/row_end: inclusive cumsums over experts, read whole
    (one round trip to memory; a binary search waits on a chain of dependent loads)."""
    idx = tl.arange(0, E_POW2)
    block_end = tl.load(block_end_ptr + idx, mask=idx < E, other=2147483647)
    row_end = tl.load(row_end_ptr + idx, mask=idx < E, other=0)
    e = tl.sum((block_end <= slot).to(tl.int32), axis=0)  # the first e with block_end[e] > slot
    first_block = tl.sum(tl.where(idx == e - 1, block_end, 0), axis=0)  # (0 for e == 0)
    row0 = tl.sum(tl.where(idx == e - 1, row_end, 0), axis=0) + (slot - first_block) * BLOCK_M
    end = tl.sum(tl.where(idx == tl.minimum(e, E - 1), row_end, 0), axis=0)
    return e, row0, end


@triton.jit
def _moe_up_kernel(
    xq_ptr, xs_ptr, order_ptr, rw_ptr, block_end_ptr, row_end_ptr,
    w_ptr, ws_ptr, hq_ptr, hs_ptr, part_ptr,
    E, TOPK, H, INTER, limit,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    stride_ps, stride_pm, KB_PER_SPLIT,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    USE_ASM: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """ws_ptr: the ue8m0 scales viewed as int32, one word per row and 128 inputs. Program
    (slot, column tile, K slice); SPLIT: store the slice's fp32 gate and up sums into
    part [slice, sorted row, gate | up] (_moe_up_finish_kernel finishes them), else finish."""
    e, row0, row_end = slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)  # sorted rows
    ok = rows < row_end
    flat = tl.load(order_ptr + rows, mask=ok, other=0)  # token * k + slot
    tok = (flat // TOPK).to(tl.int64)
    jt = tl.program_id(1)
    cols = jt * 128 + tl.arange(0, 128)  # intermediate columns: gate rows j, up rows I + j
    offs16 = tl.arange(0, 16)
    g_rows = (
        w_ptr
        + e.to(tl.int64) * stride_we
        + cols[:, None].to(tl.int64) * stride_wn
        + offs16[None, :]
    )  # [128, 16]: one chunk's bytes
    u_rows = g_rows + INTER * stride_wn
    g_scale = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn  # [128]
    u_scale = g_scale + INTER * stride_wsn
    a_rows = xq_ptr + tok[:, None] * stride_xm + 2 * offs16[None, :]  # [BM, 16]: even k
    as_row = xs_ptr + tok * stride_xsm

    acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    k0 = tl.program_id(2) * KB_PER_SPLIT
    for kb in range(k0, k0 + KB_PER_SPLIT):  # one activation scale, four weight-scale chunks
        sa = _act_scale(as_row + kb, ok)  # [BM]
        gw = tl.load(g_scale + kb)  # [128] int32: 4 scale bytes
        uw = tl.load(u_scale + kb)
        blk_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        blk_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        for c in tl.static_range(4):
            a_even, a_odd = _act_pair(a_rows + kb * 128 + c * 32, ok, INTERP)
            bg = tl.load(g_rows + kb * 64 + c * 16).to(tl.uint8, bitcast=True)
            bu = tl.load(u_rows + kb * 64 + c * 16).to(tl.uint8, bitcast=True)
            blk_g = _chunk(blk_g, a_even, a_odd, bg, gw, c, USE_ASM, INTERP)
            blk_u = _chunk(blk_u, a_even, a_odd, bu, uw, c, USE_ASM, INTERP)
        acc_g += blk_g * sa[:, None]
        acc_u += blk_u * sa[:, None]

    if SPLIT:
        part = (
            part_ptr
            + tl.program_id(2).to(tl.int64) * stride_ps
            + rows[:, None].to(tl.int64) * stride_pm
            + cols[None, :]
        )
        tl.store(part, acc_g, mask=ok[:, None])
        tl.store(part + INTER, acc_u, mask=ok[:, None])
    else:
        _finish_up(
            acc_g,
            acc_u,
            rows,
            ok,
            flat,
            jt,
            rw_ptr,
            hq_ptr,
            hs_ptr,
            stride_hm,
            stride_hsm,
            limit,
            HAS_LIMIT,
            INTERP,
        )


@triton.jit
def _finish_up(
    acc_g, acc_u, rows, ok, flat, jt,
    rw_ptr, hq_ptr, hs_ptr,
    stride_hm, stride_hsm,
    limit,
    HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """fp32 gate and up sums [BM, 128] of sorted rows `rows` (valid where ok; flat: their
    (token, slot) rows), column tile jt -> h's FP8 codes and its scale byte for these columns."""
    cols = jt * 128 + tl.arange(0, 128)
    gate = round_bf16(acc_g, INTERP)  # fp4_gemm writes bf16; Expert.forward reads it as fp32
    up = round_bf16(acc_u, INTERP)
    if HAS_LIMIT:
        up = tl.clamp(up, -limit, limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    h = tl.load(rw_ptr + flat, mask=ok, other=0.0)[:, None] * h  # routing weight, before w2
    h = round_bf16(h, INTERP)  # h.to(x.dtype)
    _, bits, _, sbyte = quantize_rows(h, INTERP)  # w2's act_quant, this program's 128 columns
    tl.store(
        hq_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], bits, mask=ok[:, None]
    )
    tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + jt, sbyte, mask=ok)


@triton.jit
def _moe_up_finish_kernel(
    part_ptr, order_ptr, rw_ptr, row_end_ptr, hq_ptr, hs_ptr,
    E, INTER, limit,
    stride_ps, stride_pm, stride_hm, stride_hsm,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Split-K gate/up: program (block of sorted rows, column tile) adds the K slices' partial
    sums in slice order, then finishes as the unsplit kernel does."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < tl.load(row_end_ptr + E - 1)  # rows of this rank's experts (others sort last)
    jt = tl.program_id(1)
    part = (
        part_ptr + rows[:, None].to(tl.int64) * stride_pm + (jt * 128 + tl.arange(0, 128))[None, :]
    )
    acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        acc_g += tl.load(part + sp * stride_ps, mask=ok[:, None], other=0.0)
        acc_u += tl.load(part + sp * stride_ps + INTER, mask=ok[:, None], other=0.0)
    flat = tl.load(order_ptr + rows, mask=ok, other=0)
    _finish_up(
        acc_g,
        acc_u,
        rows,
        ok,
        flat,
        jt,
        rw_ptr,
        hq_ptr,
        hs_ptr,
        stride_hm,
        stride_hsm,
        limit,
        HAS_LIMIT,
        INTERP,
    )


@triton.jit
def _moe_down_kernel(
    hq_ptr, hs_ptr, order_ptr, block_end_ptr, row_end_ptr, w_ptr, ws_ptr, out_ptr,
    E, H, INTER,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_os, stride_om,
    KB_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_POW2: tl.constexpr, SPLIT: tl.constexpr,
    USE_ASM: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """ws_ptr: the ue8m0 scales viewed as int32, one word per row and 128 inputs. Program
    (slot, column tile, K slice); SPLIT: out is fp32 [slice, (token, slot) row, H] and gets
    the slice's sums, else bf16 [(token, slot) row, H] and the whole sum."""
    e, row0, row_end = slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    col_ok = cols < H
    offs16 = tl.arange(0, 16)
    w_rows = (
        w_ptr
        + e.to(tl.int64) * stride_we
        + cols[:, None].to(tl.int64) * stride_wn
        + offs16[None, :]
    )  # [BN, 16]
    w_scale = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn  # [BN]
    a_rows = hq_ptr + rows[:, None].to(tl.int64) * stride_hm + 2 * offs16[None, :]  # [BM, 16]
    as_row = hs_ptr + rows.to(tl.int64) * stride_hsm

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = tl.program_id(2) * KB_PER_SPLIT
    for kb in range(k0, k0 + KB_PER_SPLIT):
        sa = _act_scale(as_row + kb, ok)
        sw = tl.load(w_scale + kb, mask=col_ok, other=0)  # [BN] int32: 4 scale bytes
        blk = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(4):
            a_even, a_odd = _act_pair(a_rows + kb * 128 + c * 32, ok, INTERP)
            b = tl.load(w_rows + kb * 64 + c * 16, mask=col_ok[:, None], other=0)
            blk = _chunk(blk, a_even, a_odd, b.to(tl.uint8, bitcast=True), sw, c, USE_ASM, INTERP)
        acc += blk * sa[:, None]

    flat = tl.load(order_ptr + rows, mask=ok, other=0).to(tl.int64)  # (token, slot) row
    out = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + flat[:, None] * stride_om
    if SPLIT:
        tl.store(out + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])
    else:
        if INTERP:  # the interpreter's bf16 cast truncates: round on the bits
            acc = round_bf16(acc, True)
        tl.store(out + cols[None, :], acc.to(tl.bfloat16), mask=ok[:, None] & col_ok[None, :])


def _as_int8(w: torch.Tensor) -> torch.Tensor:
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is not None and w.dtype == fp4x2:
        return w.view(torch.int8)
    if w.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"FP4 weights are packed int8 (or float4_e2m1fn_x2), got {w.dtype}")
    return w.view(torch.int8)


def stack_fp4_experts(
    w1: list[torch.Tensor],
    s1: list[torch.Tensor],
    w3: list[torch.Tensor],
    s3: list[torch.Tensor],
    w2: list[torch.Tensor],
    s2: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors -> the kernel's layout (w13, s13, w2, s2).

    w1[e], w3[e] [I, H/2] int8, s1[e], s3[e] [I, H/32] e8m0; w2[e] [H, I/2], s2[e] [H, I/32]."""
    w13 = torch.stack([torch.cat([_as_int8(a), _as_int8(b)]) for a, b in zip(w1, w3, strict=True)])
    s13 = torch.stack(
        [torch.cat([a.view(torch.uint8), b.view(torch.uint8)]) for a, b in zip(s1, s3, strict=True)]
    ).view(torch.float8_e8m0fnu)
    w2s = torch.stack([_as_int8(a) for a in w2])
    s2s = torch.stack([a.view(torch.uint8) for a in s2]).view(torch.float8_e8m0fnu)
    return w13, s13, w2s, s2s


def check_experts(
    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor
) -> tuple[int, int, int]:
    """Validate the stacked layout (no data read); return (E, H, I)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, rows, cols]")
    e, two_i, half_h = w13.shape
    inter, hidden = two_i // 2, 2 * half_h
    if two_i % 2 or hidden % FP8_BLOCK or inter % FP8_BLOCK:
        raise ValueError(
            f"w13 {tuple(w13.shape)}: hidden {hidden} and intermediate {inter} must "
            f"be multiples of {FP8_BLOCK}"
        )
    if tuple(w2.shape) != (e, hidden, inter // 2):
        raise ValueError(
            f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: want "
            f"{(e, hidden, inter // 2)}"
        )
    for name, s, want in (
        ("s13", s13, (e, two_i, hidden // FP4_BLOCK)),
        ("s2", s2, (e, hidden, inter // FP4_BLOCK)),
    ):
        if s.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(s.shape) != want:
            raise ValueError(
                f"{name} must be float8_e8m0fnu {want}, got {s.dtype} {tuple(s.shape)}"
            )
    for name, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    return e, hidden, inter


def check_routing(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, hidden: int
) -> None:
    """Validate a MoE call's activations and routing (no data read): x [T, hidden],
    expert_ids and weights [T, k]."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} vs experts of hidden size {hidden}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} vs x {tuple(x.shape)}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} vs expert_ids {tuple(expert_ids.shape)}")


def route_rows(
    expert_ids: torch.Tensor, n_exp: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The grouped GEMMs' row plan, computed on the device (no host sync):

    order     [R] int32: the (token, slot) rows, R = T * k, sorted by expert (stable)
    row_end   [E] int32: inclusive cumsum of each expert's rows (in sorted order)
    block_end [E] int32: inclusive cumsum of each expert's blocks of <= block_m rows
    slots     a bound on the blocks any routing of R rows can need (the launch grid)

    Ids outside [0, E) (another rank's experts) sort last, past every expert's rows: no block
    covers them, so their outputs stay zero."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < n_exp), flat, n_exp)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(n_exp + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )[:n_exp]
    row_end = counts.cumsum(0).to(torch.int32)
    block_end = ((counts + block_m - 1) // block_m).cumsum(0).to(torch.int32)
    rows = flat.numel()
    return order, row_end, block_end, triton.cdiv(rows, block_m) + min(n_exp, rows)


def fp4_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
    *,
    config: MoeConfig | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed FP4 experts; layout and semantics in the module docstring."""
    w13, w2 = _as_int8(w13), _as_int8(w2)
    n_exp, hidden, inter = check_experts(w13, s13, w2, s2)
    check_routing(x, expert_ids, weights, hidden)
    tokens, topk = expert_ids.shape
    rows = tokens * topk
    if rows == 0:
        return torch.zeros(tokens, hidden, dtype=out_dtype, device=x.device)
    cfg = config or default_config(rows, n_exp, x.device, hidden, inter)
    split_up, split_down = cfg.split_k
    if (
        cfg.block_n not in (16, 32, 64, 128, 256)
        or cfg.block_m < 16
        or (hidden // 128) % split_up
        or (inter // 128) % split_down
    ):
        raise ValueError(f"unsupported config {cfg} for hidden {hidden}, intermediate {inter}")
    dev = x.device

    xq, xs = act_quant(x)  # [T, H] e4m3, [T, H/128] e8m0
    order, row_end, block_end, slots = route_rows(expert_ids, n_exp, cfg.block_m)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()  # [R]

    hq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=dev)  # [R sorted, I]
    hs = torch.empty(rows, inter // FP8_BLOCK, dtype=torch.uint8, device=dev)  # [R, I/128] e8m0
    # one int32 word per row and 128 inputs holds that block's four per-32 scale bytes
    ws13, ws2 = s13.view(torch.uint8).view(torch.int32), s2.view(torch.uint8).view(torch.int32)
    # split-K: fp32 [slice, sorted row, gate | up] partial sums
    part = torch.empty((split_up, rows, 2 * inter) if split_up > 1 else (1, 1, 1), device=dev)
    _moe_up_kernel[(slots, inter // 128, split_up)](
        xq, xs.view(torch.uint8), order, route_w, block_end, row_end, w13, ws13,
        hq.view(torch.uint8), hs, part, n_exp, topk, hidden, inter, float(swiglu_limit),
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), ws13.stride(0), ws13.stride(1),
        hq.stride(0), hs.stride(0), part.stride(0), part.stride(1),
        (hidden // 128) // split_up,
        BLOCK_M=cfg.block_m, E_POW2=triton.next_power_of_2(n_exp), SPLIT=split_up > 1,
        HAS_LIMIT=swiglu_limit > 0, USE_ASM=cfg.use_asm and not INTERPRET, INTERP=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_up > 1:
        _moe_up_finish_kernel[(triton.cdiv(rows, cfg.block_m), inter // 128)](
            part, order, route_w, row_end, hq.view(torch.uint8), hs, n_exp, inter,
            float(swiglu_limit),
            part.stride(0), part.stride(1), hq.stride(0), hs.stride(0),
            SPLITS=split_up, BLOCK_M=cfg.block_m, HAS_LIMIT=swiglu_limit > 0, INTERP=INTERPRET,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    # [(token, slot), H] bf16; split-K: fp32 [slice, (token, slot), H], summed below. Rows
    # of other ranks' experts stay zero.
    down = torch.zeros(
        (split_down, rows, hidden) if split_down > 1 else (1, rows, hidden),
        dtype=torch.float32 if split_down > 1 else torch.bfloat16,
        device=dev,
    )
    _moe_down_kernel[(slots, triton.cdiv(hidden, cfg.block_n), split_down)](
        hq, hs, order, block_end, row_end, w2, ws2, down, n_exp, hidden, inter,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), ws2.stride(1),
        down.stride(0), down.stride(1),
        (inter // 128) // split_down,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, E_POW2=triton.next_power_of_2(n_exp),
        SPLIT=split_down > 1, USE_ASM=cfg.use_asm and not INTERPRET, INTERP=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    # the release adds each expert's bf16 output into an fp32 sum (in expert order; here in
    # slot order, which only changes the last fp32 bit)
    down = down.sum(0).to(torch.bfloat16) if split_down > 1 else down[0]
    return down.view(tokens, topk, hidden).float().sum(1).to(out_dtype)
