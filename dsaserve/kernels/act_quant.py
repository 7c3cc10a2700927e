"""Per-128 FP8 activation quantization with ue8m0 scales (Triton), and the jitted format helpers
the FP8/FP4 GEMM kernels share.

    xq, xs = act_quant(x)      # x [..., K] bf16/fp16/fp32, K % 128 == 0
                               # xq [..., K] float8_e4m3fn, xs [..., K/128] float8_e8m0fnu

Bit for bit the release's act_quant (scale_fmt "ue8m0"): see kernels.quant for the definition
and where it comes from. One program quantizes BLOCK_M rows x one 128-wide group; the grid
follows the shape only and nothing is read back to the host, so a call can be captured in a CUDA
graph.

Rounding to e4m3: on the GPU the cast is the hardware's round-to-nearest-even
(cvt.rn.satfinite.e4m3x2.f32). Triton's interpreter rounds fp32 -> fp8 wrongly (it drops bits:
124 -> 64), so under the interpreter ``e4m3_rne`` rounds in fp32 arithmetic and builds the code
from the bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.quant import ACT_AMAX_FLOOR, FP8_BLOCK, FP8_MAX


@triton.jit
def e8m0_to_f32(b):
    """uint8 ue8m0 bytes -> fp32 2^(b - 127), exactly as torch decodes them: byte 0 is the
    subnormal 2^-127, byte 255 is NaN (integer ops only, so no flush-to-zero can bite)."""
    bi = b.to(tl.int32)
    bits = tl.where(bi == 0, 0x00400000, bi << 23)
    bits = tl.where(bi == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale(x, AMAX_FLOOR: tl.constexpr, INV_MAX: tl.constexpr):
    """Per-row power-of-two scale of x [R, G] fp32, as the release's fast_round_scale:
    2^ceil(log2(max(amax, floor) * fp32(INV_MAX))) with the ceil read off the fp32 bits.

    Returns (scale [R] fp32, 1/scale [R] fp32 (exact), ue8m0 byte [R] uint8)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    bits = (amax * INV_MAX).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv, (e + 127).to(tl.uint8)


@triton.jit
def e4m3_rne(q):
    """fp32 q (|q| <= 448) -> (fp32 value of its e4m3 rounding, uint8 e4m3 code); round to
    nearest even, subnormals (quantum 2^-9) included, the sign of zero kept. Arithmetic only, for
    the interpreter (whose own fp8 cast is wrong)."""
    qbits = q.to(tl.int32, bitcast=True)
    a = tl.abs(q)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_quantum = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    n = (a * inv_quantum + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds to an integer, ties even
    r = n * quantum
    rbits = r.to(tl.int32, bitcast=True)
    re = ((rbits >> 23) & 0xFF) - 127
    normal = ((re + 7) << 3) | ((rbits >> 20) & 7)
    code = tl.where(re >= -6, normal, (r * 512.0).to(tl.int32))  # subnormal: r / 2^-9
    neg = qbits < 0
    code = tl.where(neg, code | 0x80, code)
    return tl.where(neg, -r, r), code.to(tl.uint8)


@triton.jit
def round_bf16(x, INTERP: tl.constexpr):
    """fp32 x -> fp32 value of its bf16 rounding (nearest even). The interpreter's own fp32 ->
    bf16 cast truncates, so there the rounding is done on the bits; a later .to(bf16) of the
    result is then exact on both paths."""
    if INTERP:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def quantize_rows(x, INTERP: tl.constexpr):
    """x [R, 128] fp32 -> (codes [R, 128] (fp8e4nv; fp32 values under the interpreter),
    code bits [R, 128] uint8, scale [R] fp32, scale byte [R] uint8): one act_quant group per row."""
    scale, inv, sbyte = pow2_scale(x, 1e-4, 1.0 / 448.0)
    q = tl.clamp(x * inv[:, None], -448.0, 448.0)  # x / scale, exact (power of two)
    if INTERP:
        val, bits = e4m3_rne(q)
    else:
        val = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        bits = val.to(tl.uint8, bitcast=True)
    return val, bits, scale, sbyte


# Packed e2m1 bytes -> e4m3 codes of 2^-6 * e2m1 (see fp4_to_e4m3), four bytes a 32-bit register:
# $2 in, $0 the low nibbles' codes, $1 the high nibbles'. Also kernels.hopper.fp4_moe's.
FP4_TO_E4M3_ASM = tl.constexpr(
    """
{
.reg .b32 t0, t1;
shl.b32 t0, $2, 2;
shl.b32 t1, $2, 4;
and.b32 t0, t0, 0x1C1C1C1C;
and.b32 t1, t1, 0x80808080;
or.b32 $0, t0, t1;
shr.b32 t0, $2, 2;
and.b32 t0, t0, 0x1C1C1C1C;
and.b32 t1, $2, 0x80808080;
or.b32 $1, t0, t1;
}
"""
)


@triton.jit
def fp4_to_e4m3(b, USE_ASM: tl.constexpr):
    """Packed e2m1 bytes b (uint8, any shape) -> (lo, hi) uint8 e4m3 codes of 2^-6 * e2m1 for the
    low and high nibble. Exact: e2m1 s|e1 e0|m laid into e4m3's s|eeee|mmm as s|00 e1 e0|m 0 0
    is 2^-6 times the e2m1 value, e2m1's subnormal 0.5 landing on e4m3's subnormal 2^-7.
    USE_ASM does it four bytes per 32-bit register (GPU only)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=FP4_TO_E4M3_ASM,
            constraints="=r,=r,r",
            args=[b],
            dtype=(tl.uint8, tl.uint8),
            is_pure=True,
            pack=4,
        )
    else:
        lo = ((b << 2) & 0x1C) | ((b << 4) & 0x80)
        hi = ((b >> 2) & 0x1C) | (b & 0x80)
    return lo, hi


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, stride_xm, stride_qm, stride_sm,
    BLOCK_M: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * 128 + tl.arange(0, 128)
    ok = rows < M
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=ok[:, None], other=0.0
    ).to(tl.float32)
    _, bits, _, sbyte = quantize_rows(x, INTERP)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], bits, mask=ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + group, sbyte, mask=ok)


def act_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton act_quant; semantics in kernels.quant.act_quant_reference.

    x [..., K] bf16/fp16/fp32 with K % 128 == 0 (the release asserts it) ->
    (float8_e4m3fn [..., K] contiguous, float8_e8m0fnu [..., K/128] contiguous)."""
    assert block == FP8_BLOCK, f"the kernels quantize activations per {FP8_BLOCK} only"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    k = x.shape[-1]
    if k % block != 0:
        raise ValueError(f"act_quant: last dim {k} is not a multiple of {block}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)  # [M, K]
    s = torch.empty(m, k // block, dtype=torch.float8_e8m0fnu, device=x.device)  # [M, K/128]
    block_m = 16 if m <= 16 else 32
    if m > 0:
        _act_quant_kernel[(triton.cdiv(m, block_m), k // block)](
            x2, q.view(torch.uint8), s.view(torch.uint8), m,
            x2.stride(0), q.stride(0), s.stride(0),
            BLOCK_M=block_m, INTERP=INTERPRET,
            num_warps=4,
        )  # fmt: skip
    return q.view(*x.shape), s.view(*x.shape[:-1], k // block)


assert FP8_MAX == 448.0 and ACT_AMAX_FLOOR == 1e-4  # the literals in quantize_rows
