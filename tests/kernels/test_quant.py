"""FP8 / FP4 formats of the V4 release and the quantized kernels.

(a) kernels.quant against independent transcriptions of the release's formulas (lookup tables,
    Python float math), bit for bit; (b) quantize -> dequantize round trips; (c) the Triton kernels
    under the interpreter against kernels.quant on tiny shapes (~20 ms per program instance), and
    their shape checks; (d) real shapes on CUDA (marked gpu).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
import triton
import triton.language as tl

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.kernels import fp8_gemm, quant
from dsaserve.kernels.act_quant import act_quant, fp4_to_e4m3
from dsaserve.kernels.fp4_moe import MoeConfig, fp4_moe, stack_fp4_experts
from dsaserve.kernels.fp8_gemm import GemmConfig, fp8_linear
from tests.kernels_cases import gpu_test, moe_case, random_bf16

# convert.py's FP4_TABLE, transcribed: index = the 4-bit code
RELEASE_FP4_TABLE = [
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
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, so -0.0 != 0.0 and NaN == NaN."""
    return t.float().contiguous().view(torch.int32)


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def release_round_scale(amax: float, fp_max: float) -> float:
    """fast_round_scale in Python: ceil(log2) of the fp32 product amax * fp32(1 / fp_max)."""
    t = f32(f32(amax) * f32(1.0 / fp_max))
    mant, exp = math.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    return 2.0 ** (exp - 1 if mant == 0.5 else exp)


# ---- (a) formats, bit for bit --------------------------------------------------------------------


def test_fp4_unpack_and_decode_match_release_table():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)[None]  # [1, 256]
    got = quant.e2m1_decode(quant.unpack_fp4(packed))  # [1, 512]
    lo = [RELEASE_FP4_TABLE[b & 0x0F] for b in range(256)]
    hi = [RELEASE_FP4_TABLE[b >> 4] for b in range(256)]
    want = torch.tensor([v for pair in zip(lo, hi, strict=True) for v in pair])[None]
    assert torch.equal(bits(got), bits(want))  # incl. -0.0 for code 8
    assert torch.equal(quant.pack_fp4(quant.unpack_fp4(packed)), packed)


def test_ue8m0_decode_is_two_to_the_byte_minus_127():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = quant.ue8m0_to_float(b)
    want = torch.tensor([2.0 ** (v - 127) for v in range(255)] + [float("nan")])
    assert torch.equal(bits(got[:255]), bits(want[:255])) and torch.isnan(got[255])
    assert torch.equal(bits(quant.ue8m0_to_float(b.view(torch.float8_e8m0fnu))), bits(got))


def test_dequantize_fp4_matches_release_formula():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (3, 64), generator=g, dtype=torch.int8)  # [N, K/2]
    scale = torch.randint(100, 150, (3, 4), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    got = quant.dequantize_fp4(packed, scale)
    want = torch.empty(3, 128, dtype=torch.float64)
    for n in range(3):
        for j in range(64):
            byte = int(packed[n, j]) & 0xFF
            for nib, k in ((byte & 0x0F, 2 * j), (byte >> 4, 2 * j + 1)):
                s = 2.0 ** (int(scale[n, k // 32].view(torch.uint8)) - 127)
                want[n, k] = RELEASE_FP4_TABLE[nib] * s
    assert torch.equal(bits(got), bits(want.float()))


def test_dequantize_fp8_blocks_matches_release_formula_with_partial_blocks():
    g = torch.Generator().manual_seed(2)
    n, k = 200, 300  # partial last block in both dims: scale grid [2, 3]
    w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 3), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    got = quant.dequantize_fp8_blocks(w, scale)
    want = torch.empty(n, k)
    for bi in range(2):
        for bj in range(3):
            s = 2.0 ** (int(scale[bi, bj].view(torch.uint8)) - 127)
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            want[blk] = w[blk].float() * s
    assert torch.equal(bits(got), bits(want))
    with pytest.raises(AssertionError, match="scale"):
        quant.dequantize_fp8_blocks(w, scale[:, :2])


def test_pow2_ceil_matches_release_round_scale():
    g = torch.Generator().manual_seed(3)
    amax = torch.cat(
        [
            torch.exp2(torch.randn(2000, generator=g) * 20),
            torch.tensor([448.0, 448.0 * 2**-10, 449.0, 447.9, 1e-4, 6.0, 6.0001]),
        ]
    )
    for fp_max in (quant.FP8_MAX, quant.FP4_MAX):
        got = quant.pow2_ceil(amax, 1.0 / fp_max)
        want = torch.tensor([release_round_scale(float(a), fp_max) for a in amax])
        assert torch.equal(got, want)
    assert quant.pow2_ceil(torch.tensor([448.0]), 1 / 448.0).item() == 1.0  # exact power: no +1


def test_act_quant_reference_matches_release_formula():
    x = random_bf16((4, 384), seed=4)
    x[0, :128] = 0.0  # amax floor: scale 2^-22, all codes 0
    x[1, 128:256] = 448.0 * 2**-3  # amax exactly 448 * 2^-3: scale 2^-3, not 2^-2
    x[1, 300] = -0.0
    q, s = quant.act_quant_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(q.shape) == (4, 384) and tuple(s.shape) == (4, 3)
    for r in range(4):
        for gi in range(3):
            grp = x[r, gi * 128 : (gi + 1) * 128].float()
            scale = release_round_scale(max(grp.abs().max().item(), f32(1e-4)), 448.0)
            assert quant.ue8m0_to_float(s[r, gi]).item() == scale
            want = (grp / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(
                q[r, gi * 128 : (gi + 1) * 128].view(torch.uint8), want.view(torch.uint8)
            )
    assert quant.ue8m0_to_float(s[0, 0]).item() == 2.0**-22
    assert quant.ue8m0_to_float(s[1, 1]).item() == 2.0**-3
    assert q[1, 300].view(torch.uint8).item() == 0x80  # the sign of zero survives
    with pytest.raises(AssertionError, match="multiple of 128"):
        quant.act_quant_reference(x[:, :200])


def test_round_to_e2m1_nearest_ties_to_even_saturating():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.1, -0.0, -5.5, 0.26])
    codes = quant.round_to_e2m1(v)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 8, 15, 1]


# ---- (b) round trips ---------------------------------------------------------------------------


def test_fp8_blocks_round_trip():
    g = torch.Generator().manual_seed(5)
    n, k = 130, 260
    codes = (torch.rand(n, k, generator=g) * 400 - 200).to(torch.float8_e4m3fn)
    codes[::128, ::128] = 300.0  # each block's largest code > 224: its scale is recovered exactly
    scale = torch.randint(100, 130, (2, 3), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    q, s = quant.quantize_fp8_blocks(quant.dequantize_fp8_blocks(codes, scale))
    assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8))
    # arbitrary weights: within e4m3's half quantum of the block scale
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g))
    q, s = quant.quantize_fp8_blocks(w)
    back = quant.dequantize_fp8_blocks(q, s)
    blk_scale = quant.expand_blocks(quant.ue8m0_to_float(s), n, k, 128)
    assert bool(((back - w).abs() <= w.abs() * 2**-4 + blk_scale * 2**-10).all())
    assert bool((w.abs() <= blk_scale * 448).all())


def test_fp4_round_trip_and_nearest():
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7  # 6.0 in each group: the scale is recovered exactly
    scale = torch.randint(110, 130, (8, 2), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    packed = quant.pack_fp4(codes)
    q, s = quant.quantize_fp4(quant.dequantize_fp4(packed, scale))
    back_codes = quant.unpack_fp4(q)
    zero = (codes & 7) == 0  # +0 and -0 are the same weight; the sign of zero may differ
    assert torch.equal(back_codes[~zero], codes[~zero])
    assert bool(((back_codes[zero] & 7) == 0).all())
    assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8))
    # arbitrary weights: each dequantized value is a nearest grid point of its group
    w = torch.randn(4, 96, generator=g) * 0.02
    q, s = quant.quantize_fp4(w)
    back = quant.dequantize_fp4(q, s)
    sc = quant.ue8m0_to_float(s).repeat_interleave(32, -1)
    grid = torch.tensor(RELEASE_FP4_TABLE)[None, None, :] * sc[..., None]  # [4, 96, 16]
    best = (grid - w[..., None]).abs().min(-1).values
    assert torch.equal((back - w).abs(), best)
    assert bool((w.abs() <= 6 * sc).all())


# ---- (c) Triton kernels under the interpreter ---------------------------------------------------


def test_act_quant_kernel_bit_exact():
    x = random_bf16((21, 256), seed=7, spread=20)  # 21 rows: a partial row block
    x[0, :128] = 0.0
    x[1, 5] = -0.0
    x[2, 128:] = torch.linspace(-448, 448, 128)  # many ties for the e4m3 rounding
    for inp in (x, x.float() * 1.37, x.view(3, 7, 256)):
        q, s = act_quant(inp)
        rq, rs = quant.act_quant_reference(inp)
        assert q.shape == rq.shape and s.shape == rs.shape
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 128"):
        act_quant(x[:, :100])


@triton.jit
def _fp4_probe(b_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    lo, hi = fp4_to_e4m3(tl.load(b_ptr + offs), False)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def test_fp4_to_e4m3_codes_are_exact():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = torch.empty_like(b), torch.empty_like(b)
    _fp4_probe[(1,)](b, lo, hi, N=256)
    for got, nib in ((lo, b & 0x0F), (hi, b >> 4)):
        want = torch.tensor([RELEASE_FP4_TABLE[v] for v in nib.tolist()])
        assert torch.equal(bits(got.view(torch.float8_e4m3fn).float() * 64), bits(want))


def _fp8_case(m: int, n: int, k: int, seed: int, device: str = "cpu"):
    g = torch.Generator(device).manual_seed(seed)
    row_mag = torch.exp2(torch.randint(-4, 3, (n, 1), generator=g, device=device).float())
    w = torch.randn(n, k, generator=g, device=device) * row_mag
    wq, ws = quant.quantize_fp8_blocks(w * 0.05)
    return random_bf16((m, k), seed=seed + 1, spread=4, device=device), wq, ws


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same bf16 values except for rare 1-ulp flips (the fp32 order inside a block differs)."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2**-7 + 1e-30).all())
    assert (diff == 0).float().mean().item() >= 0.98


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (3, 200, 384, GemmConfig(16, 32, 2, 1, True, 4, 1)),  # fused quant, split-K, partial tiles
        (20, 130, 256, GemmConfig(16, 64, 1, 2, False, 4, 1)),  # act_quant first, grouped order
        (5, 96, 512, None),  # default config
    ],
    ids=["fused-split", "unfused-grouped", "default"],
)
def test_fp8_linear_matches_reference(m, n, k, cfg):
    x, wq, ws = _fp8_case(m, n, k, seed=m + n)
    out = fp8_linear(x, wq, ws, config=cfg)
    assert_bf16_close(out, quant.fp8_linear_reference(x, wq, ws))


def test_fp8_gemm_prequantized_equals_linear_and_keeps_leading_dims():
    x, wq, ws = _fp8_case(6, 64, 256, seed=9)
    cfg = GemmConfig(16, 32, 1, 1, False, 4, 1)
    xq, xs = act_quant(x)
    direct = fp8_gemm.fp8_gemm(xq, xs, wq, ws, config=cfg)
    via = fp8_linear(x.view(2, 3, 256), wq, ws, config=cfg)
    assert via.shape == (2, 3, 64) and torch.equal(via.view(6, 64), direct)
    out32 = fp8_gemm.fp8_gemm(xq, xs, wq, ws, config=cfg, out_dtype=torch.float32)
    assert torch.equal(out32.to(torch.bfloat16), direct) and not torch.equal(out32, direct.float())


def test_fp8_linear_rejects_bad_shapes():
    x, wq, ws = _fp8_case(2, 64, 256, seed=10)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_linear(x[:, :192], wq[:, :192].contiguous(), ws)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, wq, ws[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, wq.float(), ws)
    with pytest.raises(ValueError, match=r"x \(2, 128\)"):
        fp8_linear(x[:, :128], wq, ws)


def test_fp8_default_config_follows_shape_only():
    dev = torch.device("cpu")  # 4 "SMs" under the interpreter
    decode = fp8_gemm.default_config(1, 128, 4096, dev)  # 2 N tiles: split K to fill the GPU
    assert decode.fuse_quant and decode.block_m == 16 and decode.split_k > 1
    rows64 = fp8_gemm.default_config(64, 1024, 4096, dev)
    assert rows64.block_m == 64 and not rows64.fuse_quant
    prefill = fp8_gemm.default_config(4096, 1024, 4096, dev)
    assert not prefill.fuse_quant and prefill.split_k == 1 and prefill.block_m == 128


def test_fp4_moe_matches_release_experts():
    x, ids, wts, w13, s13, w2, s2 = moe_case(6, 256, 128, 24, 2, seed=11)
    assert all(len(set(r)) == 2 for r in ids.tolist()) and int((ids == 1).sum()) > 16
    out = fp4_moe(x, ids, wts, w13, s13, w2, s2, 10.0, config=MoeConfig(16, 64, 4, 1, False))
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 10.0)
    assert out.dtype == torch.float32 and out.shape == (24, 256)
    # unclamped, the result differs: the limit was exercised
    assert not torch.equal(ref, quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 0.0))
    assert rel_err(out, ref) < 1e-3
    assert (out == ref).float().mean().item() > 0.95


def test_fp4_experts_add_every_slot_of_a_repeated_expert():
    """An expert id twice in a token's row: the kernel and the reference both add each (token,
    slot) pair, i.e. the sum of one call per slot (the reference once kept one of them, which a
    random hash table with repeats turned into a 2.5x error at the slice's hash layers)."""
    x, ids, wts, w13, s13, w2, s2 = moe_case(4, 128, 128, 5, 3, seed=13, skew=False)
    ids[:, 1] = ids[:, 0]
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 10.0)
    per_slot = sum(
        quant.fp4_experts_reference(x, ids[:, j : j + 1], wts[:, j : j + 1], w13, s13, w2, s2, 10.0)
        for j in range(3)
    )
    torch.testing.assert_close(ref, per_slot, rtol=1e-6, atol=1e-6)
    out = fp4_moe(x, ids, wts, w13, s13, w2, s2, 10.0)
    assert rel_err(out, ref) < 1e-3


def test_fp4_moe_without_limit_int32_ids_default_config():
    x, ids, wts, w13, s13, w2, s2 = moe_case(4, 128, 128, 5, 3, seed=12, skew=False)
    out = fp4_moe(x, ids.int(), wts, w13, s13, w2, s2, 0.0)
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 0.0)
    assert rel_err(out, ref) < 1e-3


def test_fp4_expert_ranges_add_up_to_all_experts():
    """Expert parallelism: a rank holds experts [start, stop) and gets ids - start; ids outside
    its range add nothing, so the ranks' outputs sum to the whole layer's."""
    x, ids, wts, w13, s13, w2, s2 = moe_case(6, 256, 128, 24, 2, seed=13)
    whole = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 10.0)
    parts: dict[str, list[torch.Tensor]] = {"reference": [], "triton": []}
    for start, stop in ((0, 3), (3, 6)):
        local = (w13[start:stop], s13[start:stop], w2[start:stop], s2[start:stop])
        parts["reference"].append(quant.fp4_experts_reference(x, ids - start, wts, *local, 10.0))
        parts["triton"].append(
            fp4_moe(x, ids - start, wts, *local, 10.0, config=MoeConfig(16, 64, 4, 1, False))
        )
    # top-2: a token's two expert outputs, added in either order, give the same fp32 sum
    assert torch.equal(parts["reference"][0] + parts["reference"][1], whole)
    assert rel_err(parts["triton"][0] + parts["triton"][1], whole) < 1e-3


@pytest.mark.parametrize("split_k", [(2, 2), (2, 1), (1, 2)])
def test_fp4_moe_split_k_matches_release_experts_on_every_expert_range(split_k):
    """Split-K (a decode step's few rows: fp32 slices added by a second pass) gives the
    release's arithmetic, whole and in expert-parallel halves (ids outside a rank's range)."""
    x, ids, wts, w13, s13, w2, s2 = moe_case(6, 256, 256, 5, 2, seed=14)
    split = MoeConfig(16, 64, 4, 1, False, split_k)
    for start, stop in ((0, 6), (0, 3), (3, 6)):
        local = (w13[start:stop], s13[start:stop], w2[start:stop], s2[start:stop])
        ref = quant.fp4_experts_reference(x, ids - start, wts, *local, 10.0)
        out = fp4_moe(x, ids - start, wts, *local, 10.0, config=split)
        assert rel_err(out, ref) < 1e-3, (start, stop)


def test_fp4_moe_splits_k_only_for_grids_too_small_to_fill_the_gpu():
    from dsaserve.kernels.fp4_moe import default_config

    cpu = torch.device("cpu")
    assert default_config(6, 256, cpu).split_k == (8, 4)  # one token, top-6: 96 and 192 tiles
    assert default_config(4 * 6, 256, cpu).split_k == (1, 1)  # 4 tokens: 400 and 800
    assert default_config(64 * 6, 256, cpu).split_k == (1, 1)


def test_stack_fp4_experts_layout():
    g = torch.Generator().manual_seed(13)
    per = [
        quant.quantize_fp4(torch.randn(r, c, generator=g))
        for _ in range(2)
        for r, c in ((128, 256), (128, 256), (256, 128))
    ]
    w1, w3, w2 = per[0::3], per[1::3], per[2::3]
    w13, s13, w2s, s2s = stack_fp4_experts(
        [w for w, _ in w1],
        [s for _, s in w1],
        [w for w, _ in w3],
        [s for _, s in w3],
        [w for w, _ in w2],
        [s for _, s in w2],
    )
    assert tuple(w13.shape) == (2, 256, 128) and w13.dtype == torch.int8
    assert s13.dtype == torch.float8_e8m0fnu and tuple(s13.shape) == (2, 256, 8)
    assert torch.equal(w13[1, 128:], w3[1][0]) and torch.equal(w2s[0], w2[0][0])
    assert torch.equal(s13[1, :128].view(torch.uint8), w1[1][1].view(torch.uint8))
    assert tuple(s2s.shape) == (2, 256, 4)


def test_fp4_moe_rejects_bad_layout():
    x, ids, wts, w13, s13, w2, s2 = moe_case(4, 128, 128, 3, 2, seed=14, skew=False)
    with pytest.raises(ValueError, match="w2"):
        fp4_moe(x, ids, wts, w13, s13, w2[:, :64], s2, 10.0)
    with pytest.raises(ValueError, match="s13"):
        fp4_moe(x, ids, wts, w13, s13[..., :2], w2, s2, 10.0)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp4_moe(x[:, :64], ids, wts, w13[..., :32], s13[..., :2], w2, s2, 10.0)
    with pytest.raises(ValueError, match="weights"):
        fp4_moe(x, ids, wts[:, :1], w13, s13, w2, s2, 10.0)


def test_dispatch_uses_reference_on_cpu_and_can_be_forced():
    x, wq, ws = _fp8_case(2, 64, 128, seed=15)
    ref = quant.fp8_linear_reference(x, wq, ws)
    assert torch.equal(kernels.fp8_linear(x, wq, ws), ref)
    with kernels.use_backend("triton"):
        assert_bf16_close(kernels.fp8_linear(x, wq, ws), ref)
        q, _ = kernels.quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), quant.act_quant_reference(x)[0].view(torch.uint8))


# ---- (d) real shapes on CUDA -------------------------------------------------------------------

V4_LINEARS = {
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wkv": (512, 4096),
    "wo_b": (4096, 8192),
    "shared_w1": (2048, 4096),
    "shared_w2": (4096, 2048),
    "idx_wq_b": (8192, 1024),
}


@gpu_test
def test_cuda_act_quant_bit_exact():
    x = random_bf16((4096, 4096), seed=20, spread=12, device="cuda")
    q, s = act_quant(x)
    rq, rs = quant.act_quant_reference(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


@gpu_test
@pytest.mark.parametrize("name", list(V4_LINEARS))
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_cuda_fp8_linear_v4_shapes(name, m):
    n, k = V4_LINEARS[name]
    x, wq, ws = _fp8_case(m, n, k, seed=21, device="cuda")
    out = fp8_linear(x, wq, ws)
    rows = slice(0, 64)  # the float64 reference over 64 rows is plenty
    ref = quant.fp8_linear_reference(x[rows], wq, ws)
    # fp8 tensor-core sums inside a block are not fp32-exact; bf16 output rounding dominates
    assert rel_err(out[rows], ref) < 4e-3


@gpu_test
@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(16, 64, 4, 1, True, 4, 4),
        GemmConfig(64, 128, 1, 1, False, 4, 3),
        GemmConfig(128, 128, 1, 8, False, 8, 4),
    ],
)
def test_cuda_fp8_linear_configs_agree(cfg):
    x, wq, ws = _fp8_case(64, 2048, 4096, seed=22, device="cuda")
    assert rel_err(fp8_linear(x, wq, ws, config=cfg), quant.fp8_linear_reference(x, wq, ws)) < 4e-3


@gpu_test
@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize(
    "tokens,block_m,block_n,warps,split_k",
    [
        (1, 16, 128, 4, (8, 4)),
        (64, 16, 128, 4, (1, 1)),
        (64, 16, 64, 4, (2, 2)),
        (1024, 32, 128, 8, (1, 1)),
        (1024, 64, 128, 8, (1, 1)),
    ],
)
def test_cuda_fp4_moe_v4_flash(asm, tokens, block_m, block_n, warps, split_k):
    x, ids, wts, w13, s13, w2, s2 = moe_case(
        32, 4096, 2048, tokens, 6, seed=23, skew=tokens > 64, device="cuda"
    )
    cfg = MoeConfig(block_m, block_n, warps, 3, asm, split_k)
    out = fp4_moe(x, ids, wts, w13, s13, w2, s2, 10.0, config=cfg)
    ref = quant.fp4_experts_reference(x, ids, wts, w13, s13, w2, s2, 10.0)
    assert rel_err(out, ref) < 4e-3


@gpu_test
def test_cuda_fp4_expert_ranges_add_up_to_all_experts():
    """Expert parallelism at V4-Flash widths: two ranks' halves (ids - start) sum to the whole."""
    x, ids, wts, w13, s13, w2, s2 = moe_case(32, 4096, 2048, 64, 6, seed=25, device="cuda")
    cfg = MoeConfig(16, 128, 4, 3, False)  # the same tiles for the whole and the halves
    whole = fp4_moe(x, ids, wts, w13, s13, w2, s2, 10.0, config=cfg)
    halves = [
        fp4_moe(x, ids - start, wts, w13[start:stop], s13[start:stop], w2[start:stop],
                s2[start:stop], 10.0, config=cfg)
        for start, stop in ((0, 16), (16, 32))
    ]  # fmt: skip
    assert rel_err(halves[0] + halves[1], whole) < 1e-5  # fp32 sums of the same bf16 outputs


@gpu_test
def test_cuda_fp4_moe_asm_equals_plain_decode():
    x, ids, wts, w13, s13, w2, s2 = moe_case(16, 512, 256, 8, 6, seed=24, skew=False, device="cuda")
    run = [
        fp4_moe(x, ids, wts, w13, s13, w2, s2, 10.0, config=MoeConfig(16, 64, 4, 3, asm))
        for asm in (False, True)
    ]
    assert torch.equal(*run)


@gpu_test
def test_cuda_graph_replay_follows_new_inputs():
    """No host sync: both ops capture into a graph, and replays read the new inputs."""
    x, wq, ws = _fp8_case(8, 1024, 4096, seed=25, device="cuda")
    mx, ids, wts, w13, s13, w2, s2 = moe_case(
        16, 512, 256, 8, 6, seed=26, skew=False, device="cuda"
    )
    fp8_linear(x, wq, ws), fp4_moe(mx, ids, wts, w13, s13, w2, s2, 10.0)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, wq, ws)
        my = fp4_moe(mx, ids, wts, w13, s13, w2, s2, 10.0)
    x.copy_(random_bf16((8, 4096), seed=27, device="cuda"))
    ids.copy_(torch.stack([torch.randperm(16, device="cuda")[:6] for _ in range(8)]))
    graph.replay()
    assert torch.equal(y, fp8_linear(x, wq, ws))
    assert torch.equal(my, fp4_moe(mx, ids, wts, w13, s13, w2, s2, 10.0))
