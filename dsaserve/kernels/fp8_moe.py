"""Routed experts with FP8 weights (Triton): DeepSeek-V3.2's MoE expert loop as two grouped GEMMs.

    y = fp8_moe(x, expert_ids, weights, w13, s13, w2, s2)

    x           [T, H] bf16 (fp16/fp32 accepted)
    expert_ids  [T, k] int32/int64; weights [T, k] fp32 (the gate's, route scale applied)
    w13         [E, 2I, H] float8_e4m3fn: rows 0..I-1 are the expert's w1 (gate), rows I..2I-1
                its w3 (up), each exactly as in the checkpoint
    s13         [E, 2I/128, H/128] float8_e8m0fnu: one scale per 128 x 128 block
    w2          [E, H, I] float8_e4m3fn, s2 [E, H/128, I/128] float8_e8m0fnu
    -> y        [T, H] fp32: sum over the token's experts of weight * their bf16 output; ids
                outside [0, E) add nothing (expert parallelism: other ranks hold them)

H and I multiples of 128. ``stack_fp8_experts`` builds this layout from per-expert checkpoint
tensors; the engine's loader fills it in place.

Arithmetic, as the V3.2 release (inference/model.py Expert.forward, MoE.forward, linear(),
kernel.py fp8_gemm; reference: kernels.quant.fp8_experts_reference): x is quantized once per 128
values (act_quant; the release quantizes before w1 and before w3, identically); gate and up are
fp8_gemm outputs rounded to bf16; h = silu(gate) * up in fp32, rounded to bf16 and quantized per
128 again; the down projection is rounded to bf16, then multiplied by the routing weight in fp32
(after w2, unlike V4's FP4 experts) and the token's k rows are added in fp32. Each GEMM promotes
per 128-wide K block as fp8_gemm_kernel does: an fp8 x fp8 tensor-core dot into a fresh tile,
times x_scale * w_scale (powers of two: exact), added to the fp32 accumulator.

Kernels: act_quant of x; gate/up: one program per (block of <= BLOCK_M rows of one expert, 128
intermediate columns) computes both tiles, the SwiGLU and h's act_quant (it holds the whole
128-wide group, whose weight rows share one scale row); down: one program per (row block, 128
hidden columns). Rows are sorted by expert and cut into blocks as kernels.fp4_moe does (its
`route_rows` and `slot_rows`): no host synchronisation, so decode steps can be captured in CUDA
graphs. Not split along K: a decode step of one token (8 experts x I/128 tiles) leaves SMs idle,
which kernels.fp4_moe's split-K answers for V4 (measured there; not yet here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import act_quant, e8m0_to_f32, quantize_rows, round_bf16
from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.fp4_moe import check_routing, route_rows, slot_rows
from dsaserve.kernels.quant import FP8_BLOCK


@triton.jit
def _block_dot(a_ptrs, ok, w_ptrs, sa, sw, acc, INTERP: tl.constexpr):
    """acc + (a . w^T) * sa * sw for one 128-wide K block: a [BM, 128] and w [BN, 128] e4m3."""
    a = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
    w = tl.load(w_ptrs)
    if INTERP:
        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(w))
    return acc + part * (sa[:, None] * sw)  # both powers of two: the product is exact


@triton.jit
def _act_scale(ptrs, ok):
    """ue8m0 bytes of act_quant's scales (never 0 or 255) -> fp32."""
    return (tl.load(ptrs, mask=ok, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_up_kernel(
    xq_ptr, xs_ptr, order_ptr, block_end_ptr, row_end_ptr, w_ptr, ws_ptr, hq_ptr, hs_ptr,
    E, TOPK, H, INTER,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    e, row0, row_end = slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)  # sorted rows
    ok = rows < row_end
    tok = (tl.load(order_ptr + rows, mask=ok, other=0) // TOPK).to(tl.int64)
    jt = tl.program_id(1)
    cols = jt * 128 + tl.arange(0, 128)  # intermediate columns: gate rows j, up rows I + j
    k = tl.arange(0, 128)
    g_rows = (
        w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn + k[None, :]
    )
    u_rows = g_rows + INTER * stride_wn
    g_scale = ws_ptr + e.to(tl.int64) * stride_wse + jt * stride_wsn  # the tile's block row
    u_scale = g_scale + (INTER // 128) * stride_wsn
    a_rows = xq_ptr + tok[:, None] * stride_xm + k[None, :]
    as_row = xs_ptr + tok * stride_xsm
    acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for kb in range(0, H // 128):
        sa = _act_scale(as_row + kb, ok)  # [BM]
        sg = e8m0_to_f32(tl.load(g_scale + kb))
        su = e8m0_to_f32(tl.load(u_scale + kb))
        acc_g = _block_dot(a_rows + kb * 128, ok, g_rows + kb * 128, sa, sg, acc_g, INTERP)
        acc_u = _block_dot(a_rows + kb * 128, ok, u_rows + kb * 128, sa, su, acc_u, INTERP)
    gate = round_bf16(acc_g, INTERP)  # fp8_gemm writes bf16; Expert.forward reads it as fp32
    up = round_bf16(acc_u, INTERP)
    h = round_bf16(gate / (1.0 + tl.exp(-gate)) * up, INTERP)  # silu(gate) * up, as bf16
    _, bits, _, sbyte = quantize_rows(h, INTERP)  # w2's act_quant, this program's 128 columns
    tl.store(
        hq_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], bits, mask=ok[:, None]
    )
    tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + jt, sbyte, mask=ok)


@triton.jit
def _fp8_down_kernel(
    hq_ptr, hs_ptr, order_ptr, block_end_ptr, row_end_ptr, w_ptr, ws_ptr, out_ptr,
    E, INTER,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    e, row0, row_end = slot_rows(tl.program_id(0), block_end_ptr, row_end_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < row_end
    jt = tl.program_id(1)
    cols = jt * 128 + tl.arange(0, 128)  # hidden columns: one block row of w2
    k = tl.arange(0, 128)
    w_rows = (
        w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn + k[None, :]
    )
    w_scale = ws_ptr + e.to(tl.int64) * stride_wse + jt * stride_wsn
    a_rows = hq_ptr + rows[:, None].to(tl.int64) * stride_hm + k[None, :]
    as_row = hs_ptr + rows.to(tl.int64) * stride_hsm
    acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for kb in range(0, INTER // 128):
        sa = _act_scale(as_row + kb, ok)
        sw = e8m0_to_f32(tl.load(w_scale + kb))
        acc = _block_dot(a_rows + kb * 128, ok, w_rows + kb * 128, sa, sw, acc, INTERP)
    flat = tl.load(order_ptr + rows, mask=ok, other=0).to(tl.int64)  # (token, slot) row
    out = out_ptr + flat[:, None] * stride_om + cols[None, :]
    tl.store(out, round_bf16(acc, INTERP).to(tl.bfloat16), mask=ok[:, None])


def stack_fp8_experts(
    w1: list[torch.Tensor],
    s1: list[torch.Tensor],
    w3: list[torch.Tensor],
    s3: list[torch.Tensor],
    w2: list[torch.Tensor],
    s2: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors -> the kernel's layout (w13, s13, w2, s2).

    w1[e], w3[e] [I, H] e4m3, s1[e], s3[e] [I/128, H/128] e8m0; w2[e] [H, I] e4m3,
    s2[e] [H/128, I/128] e8m0."""
    w13 = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3, strict=True)])
    s13 = torch.stack([torch.cat([a, b]) for a, b in zip(s1, s3, strict=True)])
    return w13, s13, torch.stack(w2), torch.stack(s2)


def check_experts(
    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor
) -> tuple[int, int, int]:
    """Validate the stacked layout (no data read); return (E, H, I)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, rows, cols]")
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    if two_i % 2 or hidden % FP8_BLOCK or inter % FP8_BLOCK:
        raise ValueError(
            f"w13 {tuple(w13.shape)}: hidden {hidden} and intermediate {inter} must be "
            f"multiples of {FP8_BLOCK}"
        )
    if tuple(w2.shape) != (e, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13: want {(e, hidden, inter)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != torch.float8_e4m3fn or w.stride(-1) != 1:
            raise ValueError(f"{name} must be float8_e4m3fn, contiguous along its last dim")
    for name, s, want in (
        ("s13", s13, (e, two_i // FP8_BLOCK, hidden // FP8_BLOCK)),
        ("s2", s2, (e, hidden // FP8_BLOCK, inter // FP8_BLOCK)),
    ):
        if s.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(s.shape) != want:
            raise ValueError(
                f"{name} must be float8_e8m0fnu {want}, got {s.dtype} {tuple(s.shape)}"
            )
    return e, hidden, inter


def fp8_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """Routed FP8 experts; layout and semantics in the module docstring. block_m: sorted rows a
    program takes (default: 16 for decode-sized batches, 32 for prefill)."""
    n_exp, hidden, inter = check_experts(w13, s13, w2, s2)
    check_routing(x, expert_ids, weights, hidden)
    tokens, topk = expert_ids.shape
    rows = tokens * topk
    if rows == 0:
        return torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    block_m = block_m or (16 if rows <= 16 * n_exp else 32)
    xq, xs = act_quant(x.contiguous())  # [T, H] e4m3, [T, H/128] e8m0
    order, row_end, block_end, slots = route_rows(expert_ids, n_exp, block_m)
    hq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)  # [R sorted, I]
    hs = torch.empty(rows, inter // FP8_BLOCK, dtype=torch.uint8, device=x.device)  # e8m0
    ws13, ws2 = s13.view(torch.uint8), s2.view(torch.uint8)
    e_pow2, warps = triton.next_power_of_2(n_exp), 4 if block_m == 16 else 8
    _fp8_up_kernel[(slots, inter // 128)](
        xq, xs.view(torch.uint8), order, block_end, row_end, w13, ws13, hq.view(torch.uint8), hs,
        n_exp, topk, hidden, inter,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), ws13.stride(0), ws13.stride(1),
        hq.stride(0), hs.stride(0),
        BLOCK_M=block_m, E_POW2=e_pow2, INTERP=INTERPRET,
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    # [(token, slot), H] bf16: each expert's output; rows of other ranks' experts stay zero
    down = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=x.device)
    _fp8_down_kernel[(slots, hidden // 128)](
        hq, hs, order, block_end, row_end, w2, ws2, down,
        n_exp, inter,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), ws2.stride(1),
        down.stride(0),
        BLOCK_M=block_m, E_POW2=e_pow2, INTERP=INTERPRET,
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    # the release: y += expert(x) * weight, the bf16 output times the fp32 weight, in fp32
    routed = down.float() * weights.reshape(-1, 1).float()  # [R, H]
    return routed.view(tokens, topk, hidden).sum(1)
