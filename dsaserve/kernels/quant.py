"""The DeepSeek-V4 release's weight and activation formats, in plain torch (the exact reference).

Formats (V4-Flash checkpoint, ``quantization_config`` fmt e4m3, scale_fmt ue8m0, block [128, 128]):

    FP8 linear   weight [N, K] float8_e4m3fn, ``<name>.scale`` [ceil(N/128), ceil(K/128)]
                 float8_e8m0fnu: w[n, k] = fp8[n, k] * scale[n // 128, k // 128]
    FP4 experts  weight [N, K/2] int8, two e2m1 codes per byte, the LOW nibble holding the first
                 (even) element; ``.scale`` [N, K/32] float8_e8m0fnu:
                 w[n, k] = e2m1(code[n, k]) * scale[n, k // 32]
    e2m1 code    bit 3 sign, bits 2-1 exponent, bit 0 mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    ue8m0 byte   2^(byte - 127) (byte 255 is NaN); dequantization MULTIPLIES by it, whatever the
                 HF name ``weight_scale_inv`` suggests

The release's ``linear()`` (inference/model.py) runs FP8 and FP4 weights the same way: the
activations x [..., K] (K % 128 == 0, asserted by act_quant) are quantized per 128 values with a
power-of-two scale, then ``fp8_gemm`` / ``fp4_gemm`` (TileLang, inference/kernel.py) compute

    fp8:  for each 128-wide K block b:  C += (sum_{k in b} xq * wq) * (xs[m, b] * ws[n/128, b])
    fp4:  for each  32-wide K chunk c:  C += (sum_{k in c} xq * e2m1) * xs[m, c/4] * ws[n, c]

with the block sum on tensor cores (fp32 accumulate, fresh per block) and C an fp32 register
accumulator, written as bf16 (torch's default dtype in the release). act_quant:
amax = max(|x|) per 128 in fp32, floored at 1e-4; scale = 2^ceil(log2(amax * fp32(1/448))) with
the ceil taken on the fp32 bits (exponent, +1 if any mantissa bit); xq = e4m3(clamp(x / scale,
+-448)) rounded to nearest even; the scale is stored as ue8m0 (``scale_dtype`` fp8 in the release's
ModelArgs defaults).

Where each fact was read:
- act_quant / fast_log2_ceil / fast_round_scale / fp8_gemm_kernel / fp4_gemm_kernel (block 32,
  fp4 -> fp32 -> fp8 cast, C_local * scale_a * scale_b per chunk) / fp4_quant_kernel (amax floor
  6 * 2^-126, scale = fast_round_scale(amax, 1/6)): the release's inference/kernel.py, read in the
  mirror GitHub supermy/ds4rs (inference/kernel.py); act_quant's amax floor and ceil also in the
  V3.2 copy of the same kernel in SGLang.
- linear() dispatch, Linear's weight/scale shapes, block_size 128 / fp4_block_size 32,
  scale_fmt "ue8m0" + scale_dtype float8_e8m0fnu, Expert.forward (below): inference/model.py in
  the same mirror; the Expert body also matches several independent copies of the release.
- nibble order and value table (low nibble first; FP4_TABLE with -0.0 for code 8): the release's
  inference/convert.py (``cast_e2m1fn_to_e4m3fn``), HF transformers integrations/mxfp4.py
  (``FP4_VALUES``, ``blk & 0x0F`` -> even columns) and integrations/finegrained_fp8.py
  (``_unpack_fp4``, ``_dequantize_one``: q * s).
- scale multiplies: convert.py (``wo_a`` is dequantized to bf16 as weight * scale; FP4 -> FP8 keeps
  table * scale), HF finegrained_fp8 ``_dequantize_fp8_weight`` (weight.mul_(scale), with the
  partial last row/column block of a ceil-shaped scale grid).

Numerics here: block sums are formed in float64 (exact for these products) and rounded once to
fp32, then accumulated in fp32 in K order, so results equal any fp32 tensor-core implementation
up to the order of the additions inside one block.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
FP8_BLOCK = 128  # weight blocks (128 x 128) and activation groups
FP4_BLOCK = 32  # FP4 weight scale group (input values)
ACT_AMAX_FLOOR = 1e-4  # act_quant's floor on amax (so an all-zero group gets scale 2^-22)
FP4_AMAX_FLOOR = 6 * 2.0**-126  # fp4_quant_kernel's floor

# e2m1 code -> value, code 8 is -0.0 (sign bit set on zero)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


# ---- scales ------------------------------------------------------------------------------------


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its uint8 bytes) -> fp32 2^(byte - 127); byte 255 -> NaN."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    assert scale.dtype == torch.float8_e8m0fnu, f"expected e8m0 scales, got {scale.dtype}"
    return scale.float()


def pow2_ceil(amax: torch.Tensor, inv_max: float) -> torch.Tensor:
    """2^ceil(log2(amax * inv_max)) computed as the release's fast_round_scale does: the product
    in fp32, the ceil read off its bits (exponent - 127, +1 if any mantissa bit is set).

    amax fp32 > 0 (normal after the product). Returns fp32 powers of two."""
    t = amax.float() * torch.tensor(inv_max, dtype=torch.float32)
    bits = t.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exp + 127) << 23).view(torch.float32)


def _to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two (2^-127 .. 2^127) -> float8_e8m0fnu, exactly."""
    return scale.to(torch.float8_e8m0fnu)


# ---- FP4 (e2m1) codes --------------------------------------------------------------------------


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 -> fp32 values, by the bit layout (sign | 2-bit exponent | mantissa)."""
    code = code.to(torch.int32)
    exp, man = (code >> 1) & 3, (code & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2((exp - 1).float()) * (1.0 + 0.5 * man))
    return torch.where((code & 8) != 0, -mag, mag)  # -0.0 for code 8


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., K/2] -> e2m1 codes as uint8 [..., K]; element 2j is byte j's low nibble."""
    assert packed.dtype in (torch.int8, torch.uint8), f"packed FP4 is int8, got {packed.dtype}"
    u8 = packed.view(torch.uint8)
    return torch.stack([u8 & 0x0F, u8 >> 4], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) [..., K] -> int8 [..., K/2], the inverse of unpack_fp4."""
    assert codes.shape[-1] % 2 == 0, "an even number of FP4 values per row"
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale, |v| <= 6 after clamping) -> e2m1 codes, round
    to nearest, ties to the even code (as the hardware's cvt.rn.satfinite.e2m1x2 does)."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=v.device)
    a = v.float().abs().clamp(max=FP4_MAX)
    lo = (torch.searchsorted(mags, a, right=True) - 1).clamp(0, 7)  # largest magnitude <= a
    hi = (lo + 1).clamp(max=7)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))  # a tie goes to the even code
    code = torch.where(up & (hi != lo), hi, lo)
    # keep the sign of negative values (incl. -0.0 -> code 8), as a sign-magnitude cast does
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


# ---- dequantization ----------------------------------------------------------------------------


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """[ceil(rows/b), ceil(cols/b)] -> [rows, cols]: each block's scale over its elements."""
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK
) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale [ceil(N/block), ceil(K/block)] e8m0 -> fp32 [N, K]."""
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, weight.dtype
    n, k = weight.shape
    want = (-(-n // block), -(-k // block))
    assert tuple(scale.shape) == want, f"scale {tuple(scale.shape)} for weight {n}x{k}: want {want}"
    return weight.float() * expand_blocks(ue8m0_to_float(scale), n, k, block)


def narrow_fp4_scales(*scales: torch.Tensor) -> bool:
    """Whether every ue8m0 byte of these FP4 weight scales is <= 128 (scale <= 2), which the
    Hopper kernel's faster decode needs (kernels.hopper.fp4_moe). Reads the tensors back:
    call it once, where the weights are loaded."""
    return all(bool((s.view(torch.uint8) <= 128).all()) for s in scales)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [..., N, K/2] int8, scale [..., N, K/32] e8m0 -> fp32 [..., N, K]."""
    values = e2m1_decode(unpack_fp4(packed))  # [..., N, K]
    k = values.shape[-1]
    assert k % FP4_BLOCK == 0 and scale.shape[-1] == k // FP4_BLOCK, (
        f"scale {tuple(scale.shape)} for {k} FP4 values per row: want {k // FP4_BLOCK} per row"
    )
    assert scale.shape[:-1] == values.shape[:-1], f"{tuple(scale.shape)} vs {tuple(values.shape)}"
    return values * ue8m0_to_float(scale).repeat_interleave(FP4_BLOCK, -1)


# ---- quantization ------------------------------------------------------------------------------


def act_quant_reference(
    x: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's act_quant with scale_fmt "ue8m0": x [..., K] (K % block == 0) ->
    (float8_e4m3fn [..., K], float8_e8m0fnu [..., K / block])."""
    k = x.shape[-1]
    assert k % block == 0, f"last dim {k} must be a multiple of {block} (the release asserts it)"
    groups = x.float().unflatten(-1, (k // block, block))  # [..., G, block]
    amax = groups.abs().amax(-1).clamp(min=ACT_AMAX_FLOOR)  # [..., G]
    scale = pow2_ceil(amax, 1.0 / FP8_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), _to_e8m0(scale)


def quantize_fp8_blocks(
    weight: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (float8_e4m3fn [N, K], e8m0 [ceil(N/block), ceil(K/block)]).

    The checkpoint's producer is not public; this writes the format's convention: per block a
    power-of-two scale 2^ceil(log2(amax/448)) (act_quant's rounding; amax floored at 1e-4), values
    rounded to nearest even. Dequantizing and quantizing again returns the same tensors whenever
    each block's largest code exceeds 224 in magnitude."""
    n, k = weight.shape
    bn, bk = -(-n // block), -(-k // block)
    padded = weight.new_zeros(bn * block, bk * block, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(bn, block, bk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=ACT_AMAX_FLOOR)  # [bn, bk]
    scale = pow2_ceil(amax, 1.0 / FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bn * block, bk * block)[:n, :k].contiguous(), _to_e8m0(scale)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float (K % 32 == 0) -> (int8 [..., N, K/2], e8m0 [..., N, K/32]).

    As the release's fp4_quant_kernel: per 32 values amax (floored at 6 * 2^-126), scale
    2^ceil(log2(amax * fp32(1/6))), codes = e2m1 round-to-nearest-even of x / scale."""
    k = weight.shape[-1]
    assert k % FP4_BLOCK == 0, f"last dim {k} must be a multiple of {FP4_BLOCK}"
    groups = weight.float().unflatten(-1, (k // FP4_BLOCK, FP4_BLOCK))
    amax = groups.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR)
    scale = pow2_ceil(amax, 1.0 / FP4_MAX)
    codes = round_to_e2m1((groups / scale[..., None]).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return pack_fp4(codes), _to_e8m0(scale)


# ---- the release's linear() and Expert arithmetic -----------------------------------------------


# Bytes of float64 chunk sums _blockwise_gemm holds at once: [C, M, N] whole at a 2048-row
# prefill of a 7168 x 18432 layer is 17 GB, which ran an 80 GB GPU out of memory mid-bench
BLOCK_SUMS_BYTES = 1 << 28


def _blockwise_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, chunk: int
) -> torch.Tensor:
    """sum over K chunks (in order) of fp32(exact chunk dot) * x_scale * w_scale, in fp32.

    xq [M, K] fp32 values of fp8 codes, x_scale [M, K/128] fp32, w [N, K] fp32 code values,
    w_scale [N, K/chunk] fp32 (per output row and chunk). Returns fp32 [M, N]."""
    m, k = xq.shape
    n = w.shape[0]
    chunks = k // chunk
    xs = x_scale.repeat_interleave(FP8_BLOCK // chunk, -1).t()  # [C, M]
    xd = xq.double().view(m, chunks, chunk)
    wd = w.double().view(n, chunks, chunk)
    acc = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    step = max(1, BLOCK_SUMS_BYTES // (8 * m * n))  # chunks whose sums are formed at once
    for c0 in range(0, chunks, step):
        # [c, M, N]: each chunk's sum of exact products, rounded once to fp32
        parts = torch.einsum("mck,nck->cmn", xd[:, c0 : c0 + step], wd[:, c0 : c0 + step]).float()
        for i, c in enumerate(range(c0, min(c0 + step, chunks))):
            # the release's order: one chunk after the other, fp32
            acc += parts[i] * xs[c][:, None] * w_scale[:, c][None, :]
    return acc


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The release's linear() on an FP8 weight: x [..., K] -> [..., N] out_dtype (bf16 in the
    release; fp32 for the partial sums of a layer whose K is split across ranks).

    weight [N, K] float8_e4m3fn, scale [ceil(N/128), K/128] e8m0 (K % 128 == 0)."""
    n, k = weight.shape
    assert x.shape[-1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert tuple(scale.shape) == (-(-n // FP8_BLOCK), k // FP8_BLOCK), tuple(scale.shape)
    xq, xs = act_quant_reference(x.reshape(-1, k))
    ws = ue8m0_to_float(scale).repeat_interleave(FP8_BLOCK, 0)[:n]  # [N, K/128]
    y = _blockwise_gemm(xq.float(), ue8m0_to_float(xs), weight.float(), ws, FP8_BLOCK)
    return y.to(out_dtype).view(*x.shape[:-1], n)


def fp4_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The release's linear() on an FP4 weight: x [..., K] -> bf16 [..., N].

    weight [N, K/2] int8 (packed e2m1), scale [N, K/32] e8m0 (K % 128 == 0)."""
    n, k = weight.shape[0], 2 * weight.shape[1]
    assert x.shape[-1] == k, f"x {tuple(x.shape)} vs FP4 weight of {k} inputs"
    assert tuple(scale.shape) == (n, k // FP4_BLOCK), tuple(scale.shape)
    xq, xs = act_quant_reference(x.reshape(-1, k))
    w = e2m1_decode(unpack_fp4(weight))  # [N, K] code values
    y = _blockwise_gemm(xq.float(), ue8m0_to_float(xs), w, ue8m0_to_float(scale), FP4_BLOCK)
    return y.to(torch.bfloat16).view(*x.shape[:-1], n)


def fp4_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """The release's routed experts (MoE.forward's expert loop, Expert.forward) -> fp32 [T, H].

    x [T, H] bf16; expert_ids [T, k]; weights [T, k] fp32; w13 [E, 2I, H/2] int8 (rows 0..I-1
    are w1 = gate, I..2I-1 are w3 = up), s13 [E, 2I, H/32]; w2 [E, H, I/2], s2 [E, H, I/32].
    Per expert e and its rows: gate, up = bf16(fp4 linear) each; h = silu(min(gate, L)) *
    clamp(up, -L, L) in fp32 (no clamp when L <= 0), times the routing weight, cast to bf16;
    out = bf16(fp4 linear(h, w2)); y (fp32) += out, experts in ascending id order. Ids outside
    [0, E) add nothing (experts held by other ranks under expert parallelism). Every (token,
    slot) pair adds, an expert id repeated in a token's row too (as the kernels and the dense
    experts sum them; the release's `y[idx] +=` would keep one, but its routers never repeat
    an expert)."""
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = torch.where(expert_ids == e)
        xe = x[tok]
        gate = fp4_linear_reference(xe, w13[e, :inter], s13[e, :inter]).float()
        up = fp4_linear_reference(xe, w13[e, inter:], s13[e, inter:]).float()
        if swiglu_limit > 0:
            up = up.clamp(-swiglu_limit, swiglu_limit)
            gate = gate.clamp(max=swiglu_limit)
        h = weights[tok, slot, None].float() * (torch.nn.functional.silu(gate) * up)
        y.index_add_(0, tok, fp4_linear_reference(h.to(x.dtype), w2[e], s2[e]).float())
    return y


def fp8_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
) -> torch.Tensor:
    """DeepSeek-V3.2's routed experts (MoE.forward's expert loop, Expert.forward) -> fp32 [T, H].

    x [T, H] bf16; expert_ids [T, k]; weights [T, k] fp32; w13 [E, 2I, H] e4m3 (rows 0..I-1
    are w1 = gate, I..2I-1 are w3 = up), s13 [E, 2I/128, H/128] e8m0; w2 [E, H, I], s2
    [E, H/128, I/128]. Per expert e and its rows: gate, up = bf16(fp8 linear) each; h =
    silu(gate) * up in fp32, cast to bf16 (the release's dtype); out = bf16(fp8 linear(h, w2));
    y (fp32) += out * routing weight, experts in ascending id order. Ids outside [0, E) add
    nothing (experts held by other ranks under expert parallelism); a repeated id adds per
    slot, as in fp4_experts_reference."""
    inter, blocks = w13.shape[1] // 2, w13.shape[1] // 2 // FP8_BLOCK
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = torch.where(expert_ids == e)
        xe = x[tok]
        gate = fp8_linear_reference(xe, w13[e, :inter], s13[e, :blocks]).float()
        up = fp8_linear_reference(xe, w13[e, inter:], s13[e, blocks:]).float()
        h = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        out = fp8_linear_reference(h, w2[e], s2[e]).float()
        y.index_add_(0, tok, out * weights[tok, slot, None].float())
    return y
