"""Routed experts with FP4 weights (Triton): the release's MoE expert loop as two grouped GEMMs.

    y = fp4_moe(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)

    x           [T, H] bf16 (fp16/fp32 accepted)
    expert_ids  [T, k] int32/int64; weights [T, k] fp32 (the gate's, route scale applied)
    w13         [E, 2I, H/2] int8: two e2m1 codes per byte, low nibble first; rows 0..I-1 are the
                expert's w1 (gate), rows I..2I-1 its w3 (up), each exactly as in the checkpoint
    s13         [E, 2I, H/32] float8_e8m0fnu: one scale per 32 inputs
    w2          [E, H, I/2] int8, s2 [E, H, I/32] float8_e8m0fnu
    -> y        [T, H] fp32 (out_dtype): sum over the token's experts of their bf16 outputs

H and I multiples of 128. ``stack_fp4_experts`` builds this layout from per-expert checkpoint
tensors (``layers.N.ffn.experts.E.w{1,2,3}.{weight,scale}``); the engine's loader stacks them once.

Arithmetic, as the release (inference/model.py Expert.forward, linear(), kernel.py fp4_gemm;
reference: kernels.quant.fp4_experts_reference): x is quantized once per 128 values (act_quant:
the release quantizes before w1 and before w3, identically); gate and up are fp4_gemm outputs
rounded to bf16; h = silu(min(gate, L)) * clamp(up, -L, L) in fp32, times the routing weight
(before w2, unlike engine/moe.py's bf16 path), rounded to bf16 and quantized per 128 again; the
down projection's bf16 outputs are added in fp32. Each fp4 GEMM promotes per 32-value chunk like
fp4_gemm_kernel: an fp8 tensor-core dot of the chunk into a fresh fp32 tile, times
x_scale * w_scale, added to the fp32 accumulator.

The weights never leave FP4 in memory: a program loads packed bytes and turns each nibble into
the e4m3 code of 2^-6 times its e2m1 value with a few bit operations (kernels.act_quant
.fp4_to_e4m3, four bytes per instruction in inline PTX on the GPU; the 2^6 goes into the chunk's
scale), so the dot runs on fp8 operands and the result is bit-identical to fp4_gemm's
fp4 -> fp32 -> fp8 cast.

Kernels:
1. act_quant of x.
2. gate/up: one program per (block of <= BLOCK_M rows of one expert, 128 intermediate columns)
   computes the gate and the up tile (weight rows j and I + j), applies the clamped SwiGLU and the
   routing weight, and quantizes h per 128 right there (it holds the whole 128-wide group).
3. down: one program per (row block, BLOCK_N output columns); bf16 rows land at the token's
   (token, slot) row; the k rows of a token are then summed in fp32.
Rows are sorted by expert (stable argsort, as engine/moe.py's RoutedExperts) and each expert's
rows are cut into BLOCK_M blocks; the grid has ceil(T*k / BLOCK_M) + min(E, T*k) block slots, a
bound on the blocks any routing can need, and a program finds its expert by binary search over
the per-expert block counts, so nothing is read back to the host (CUDA-graph capturable). Idle
slots return at once. Decode (64 tokens, top-6, 256 experts: ~1.5 rows per expert) is bound by
reading the FP4 weights of the ~200 experts hit, 4x fewer bytes than bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.act_quant import act_quant, e8m0_to_f32, fp4_to_e4m3, quantize_rows, round_bf16
from kernels.env import INTERPRET
from kernels.quant import FP4_BLOCK, FP8_BLOCK


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted rows per program, all of one expert (>= 16: tl.dot's minimum)
    block_n: int  # down-projection output columns per program
    num_warps: int
    num_stages: int
    use_asm: bool  # decode nibbles four bytes per instruction (inline PTX; GPU only)


def default_config(rows: int, experts: int, device: torch.device) -> MoeConfig:
    """Shape-only choice. rows = T * k."""
    per_expert = rows / max(experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    # the inline-PTX nibble decode takes ~5 instructions per 4 bytes against ~9 per byte in
    # plain Triton, which would make a decode step ALU-bound below the HBM rate
    return MoeConfig(block_m, 64, 4, 4, device.type == "cuda")


@triton.jit
def _fp4_tile(b, USE_ASM: tl.constexpr, INTERP: tl.constexpr):
    """Packed bytes [R, 16] -> [R, 32] e4m3 operand (fp32 values under the interpreter) of
    2^-6 * e2m1, in natural order: element 2j from byte j's low nibble."""
    lo, hi = fp4_to_e4m3(b, USE_ASM)
    w = tl.interleave(lo, hi).to(tl.float8e4nv, bitcast=True)
    if INTERP:
        w = w.to(tl.float32)
    return w


@triton.jit
def _slot_rows(slot, block_end_ptr, row_end_ptr, E, BLOCK_M: tl.constexpr, STEPS: tl.constexpr):
    """Block slot -> (expert, first sorted row, end of the expert's rows); expert == E when the
    slot is past the last block. block_end/row_end: inclusive cumsums over experts."""
    lo = 0
    hi = E
    for _ in tl.static_range(STEPS):  # lower bound: the first e with block_end[e] > slot
        mid = (lo + hi) // 2
        active = lo < hi
        above = tl.load(block_end_ptr + tl.minimum(mid, E - 1)) > slot
        lo = tl.where(active & ~above, mid + 1, lo)
        hi = tl.where(active & above, mid, hi)
    e = lo
    prev = tl.maximum(e - 1, 0)
    first_block = tl.where(e > 0, tl.load(block_end_ptr + prev), 0)
    row0 = tl.where(e > 0, tl.load(row_end_ptr + prev), 0) + (slot - first_block) * BLOCK_M
    row_end = tl.load(row_end_ptr + tl.minimum(e, E - 1))
    return e, row0, row_end


@triton.jit
def _moe_up_kernel(
    xq_ptr, xs_ptr, order_ptr, rw_ptr, block_end_ptr, row_end_ptr,  #
    w_ptr, ws_ptr, hq_ptr, hs_ptr,  #
    E, TOPK, H, INTER, limit,  #
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    BLOCK_M: tl.constexpr, STEPS: tl.constexpr, HAS_LIMIT: tl.constexpr,  #
    USE_ASM: tl.constexpr, INTERP: tl.constexpr,  #
):
    e, row0, row_end = _slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, BLOCK_M, STEPS)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)  # sorted rows
    ok = rows < row_end
    flat = tl.load(order_ptr + rows, mask=ok, other=0)  # token * k + slot
    tok = (flat // TOPK).to(tl.int64)
    jt = tl.program_id(1)
    cols = jt * 128 + tl.arange(0, 128)  # intermediate columns: gate rows j, up rows I + j
    offs16 = tl.arange(0, 16)
    offs32 = tl.arange(0, 32)
    g_rows = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn \
        + offs16[None, :]  # [128, 16] bytes of one chunk
    u_rows = g_rows + INTER * stride_wn
    g_scale = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn  # [128]
    u_scale = g_scale + INTER * stride_wsn
    a_rows = xq_ptr + tok[:, None] * stride_xm + offs32[None, :]  # [BM, 32]
    as_row = xs_ptr + tok * stride_xsm

    acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for c in range(0, H // 32):  # one 32-value chunk (one weight scale) per step
        a = tl.load(a_rows + c * 32, mask=ok[:, None], other=0.0)
        if INTERP:
            a = a.to(tl.float32)
        sa = e8m0_to_f32(tl.load(as_row + c // 4, mask=ok, other=127))  # [BM]
        wg = _fp4_tile(tl.load(g_rows + c * 16).to(tl.uint8, bitcast=True), USE_ASM, INTERP)
        wu = _fp4_tile(tl.load(u_rows + c * 16).to(tl.uint8, bitcast=True), USE_ASM, INTERP)
        sg = e8m0_to_f32(tl.load(g_scale + c)) * 64.0  # undo the 2^-6 of the e4m3 codes
        su = e8m0_to_f32(tl.load(u_scale + c)) * 64.0
        pg = tl.dot(a, tl.trans(wg), input_precision="ieee" if INTERP else "tf32")
        acc_g += pg * (sa[:, None] * sg[None, :])
        pu = tl.dot(a, tl.trans(wu), input_precision="ieee" if INTERP else "tf32")
        acc_u += pu * (sa[:, None] * su[None, :])

    gate = round_bf16(acc_g, INTERP)  # fp4_gemm writes bf16; Expert.forward reads it as fp32
    up = round_bf16(acc_u, INTERP)
    if HAS_LIMIT:
        up = tl.clamp(up, -limit, limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    h = tl.load(rw_ptr + flat, mask=ok, other=0.0)[:, None] * h  # routing weight, before w2
    h = round_bf16(h, INTERP)  # h.to(x.dtype)
    _, bits, _, sbyte = quantize_rows(h, INTERP)  # w2's act_quant, this program's 128 columns
    tl.store(hq_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], bits,
             mask=ok[:, None])
    tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + jt, sbyte, mask=ok)


@triton.jit
def _moe_down_kernel(
    hq_ptr, hs_ptr, order_ptr, block_end_ptr, row_end_ptr, w_ptr, ws_ptr, out_ptr,  #
    E, H, INTER,  #
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,  #
    USE_ASM: tl.constexpr, INTERP: tl.constexpr,  #
):
    e, row0, row_end = _slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, BLOCK_M, STEPS)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    col_ok = cols < H
    offs16 = tl.arange(0, 16)
    offs32 = tl.arange(0, 32)
    w_rows = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn \
        + offs16[None, :]  # [BN, 16]
    w_scale = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn  # [BN]
    a_rows = hq_ptr + rows[:, None].to(tl.int64) * stride_hm + offs32[None, :]  # [BM, 32]
    as_row = hs_ptr + rows.to(tl.int64) * stride_hsm

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c in range(0, INTER // 32):
        a = tl.load(a_rows + c * 32, mask=ok[:, None], other=0.0)
        if INTERP:
            a = a.to(tl.float32)
        sa = e8m0_to_f32(tl.load(as_row + c // 4, mask=ok, other=127))
        b = tl.load(w_rows + c * 16, mask=col_ok[:, None], other=0).to(tl.uint8, bitcast=True)
        w = _fp4_tile(b, USE_ASM, INTERP)
        sw = e8m0_to_f32(tl.load(w_scale + c, mask=col_ok, other=127)) * 64.0
        part = tl.dot(a, tl.trans(w), input_precision="ieee" if INTERP else "tf32")
        acc += part * (sa[:, None] * sw[None, :])

    if INTERP:  # the interpreter's bf16 cast truncates: round on the bits
        acc = round_bf16(acc, True)
    flat = tl.load(order_ptr + rows, mask=ok, other=0).to(tl.int64)  # (token, slot) row
    tl.store(out_ptr + flat[:, None] * stride_om + cols[None, :], acc.to(tl.bfloat16),
             mask=ok[:, None] & col_ok[None, :])


def _as_int8(w: torch.Tensor) -> torch.Tensor:
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is not None and w.dtype == fp4x2:
        return w.view(torch.int8)
    if w.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"FP4 weights are packed int8 (or float4_e2m1fn_x2), got {w.dtype}")
    return w.view(torch.int8)


def stack_fp4_experts(w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor],
                      s3: list[torch.Tensor], w2: list[torch.Tensor], s2: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors -> the kernel's layout (w13, s13, w2, s2).

    w1[e], w3[e] [I, H/2] int8, s1[e], s3[e] [I, H/32] e8m0; w2[e] [H, I/2], s2[e] [H, I/32]."""
    w13 = torch.stack([torch.cat([_as_int8(a), _as_int8(b)]) for a, b in zip(w1, w3)])
    s13 = torch.stack([torch.cat([a.view(torch.uint8), b.view(torch.uint8)])
                       for a, b in zip(s1, s3)]).view(torch.float8_e8m0fnu)
    w2s = torch.stack([_as_int8(a) for a in w2])
    s2s = torch.stack([a.view(torch.uint8) for a in s2]).view(torch.float8_e8m0fnu)
    return w13, s13, w2s, s2s


def check_experts(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor
                  ) -> tuple[int, int, int]:
    """Validate the stacked layout (no data read); return (E, H, I)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, rows, cols]")
    e, two_i, half_h = w13.shape
    inter, hidden = two_i // 2, 2 * half_h
    if two_i % 2 or hidden % FP8_BLOCK or inter % FP8_BLOCK:
        raise ValueError(f"w13 {tuple(w13.shape)}: hidden {hidden} and intermediate {inter} must "
                         f"be multiples of {FP8_BLOCK}")
    if tuple(w2.shape) != (e, hidden, inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: want "
                         f"{(e, hidden, inter // 2)}")
    for name, s, want in (("s13", s13, (e, two_i, hidden // FP4_BLOCK)),
                          ("s2", s2, (e, hidden, inter // FP4_BLOCK))):
        if s.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(s.shape) != want:
            raise ValueError(f"{name} must be float8_e8m0fnu {want}, got {s.dtype} "
                             f"{tuple(s.shape)}")
    for name, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    return e, hidden, inter


def fp4_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
            w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
            swiglu_limit: float, *, config: MoeConfig | None = None,
            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Routed FP4 experts; layout and semantics in the module docstring."""
    w13, w2 = _as_int8(w13), _as_int8(w2)
    n_exp, hidden, inter = check_experts(w13, s13, w2, s2)
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} vs experts of hidden size {hidden}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} vs x {tuple(x.shape)}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} vs expert_ids {tuple(expert_ids.shape)}")
    tokens, topk = expert_ids.shape
    rows = tokens * topk
    if rows == 0:
        return torch.zeros(tokens, hidden, dtype=out_dtype, device=x.device)
    cfg = config or default_config(rows, n_exp, x.device)
    if cfg.block_n not in (16, 32, 64, 128, 256) or cfg.block_m < 16:
        raise ValueError(f"unsupported config {cfg}")
    dev = x.device

    xq, xs = act_quant(x)  # [T, H] e4m3, [T, H/128] e8m0
    flat = expert_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True).to(torch.int32)  # [R] (token, slot) rows by expert
    counts = torch.zeros(n_exp, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    row_end = counts.cumsum(0).to(torch.int32)  # [E]
    block_end = ((counts + cfg.block_m - 1) // cfg.block_m).cumsum(0).to(torch.int32)  # [E]
    slots = triton.cdiv(rows, cfg.block_m) + min(n_exp, rows)
    steps = max(1, n_exp.bit_length())
    route_w = weights.reshape(-1).to(torch.float32).contiguous()  # [R]

    hq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=dev)  # [R sorted, I]
    hs = torch.empty(rows, inter // FP8_BLOCK, dtype=torch.uint8, device=dev)  # [R, I/128] e8m0
    ws13, ws2 = s13.view(torch.uint8), s2.view(torch.uint8)
    _moe_up_kernel[(slots, inter // 128)](
        xq, xs.view(torch.uint8), order, route_w, block_end, row_end,
        w13, ws13, hq.view(torch.uint8), hs,
        n_exp, topk, hidden, inter, float(swiglu_limit),
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), ws13.stride(0), ws13.stride(1),
        hq.stride(0), hs.stride(0),
        BLOCK_M=cfg.block_m, STEPS=steps, HAS_LIMIT=swiglu_limit > 0,
        USE_ASM=cfg.use_asm and not INTERPRET, INTERP=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    down = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)  # [(token, slot), H]
    _moe_down_kernel[(slots, triton.cdiv(hidden, cfg.block_n))](
        hq, hs, order, block_end, row_end, w2, ws2, down,
        n_exp, hidden, inter,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), ws2.stride(1),
        down.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STEPS=steps,
        USE_ASM=cfg.use_asm and not INTERPRET, INTERP=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # the release adds each expert's bf16 output into an fp32 sum (in expert order; here in
    # slot order, which only changes the last fp32 bit)
    return down.view(tokens, topk, hidden).float().sum(1).to(out_dtype)
