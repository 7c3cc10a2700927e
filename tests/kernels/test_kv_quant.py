"""FP8 KV cache formats (kernels.kv_quant): page bytes against an independent transcription of the
layout written here (struct packing, e4m3 from its bit formula, scales from frexp), round-trip
bounds, and the Triton quantize-on-write kernels (interpreter on CPU, compiled on CUDA) against
the torch reference, byte for byte. The read kernels are tested in test_kernels_sparse_mla.py and
test_kernels_indexer.py."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dsaserve import kernels
from dsaserve.kernels import kv_quant
from tests.kernels_cases import gpu_test

SENTINEL = 0xA5  # bytes no write may touch


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def e4m3_value(code: int) -> float:
    """e4m3fn from its bits: sign | 4-bit exponent (bias 7) | 3-bit mantissa, subnormals 2^-9."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 7
    mag = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return sign * mag


POSITIVE = [e4m3_value(c) for c in range(0x7F)]  # 0x7F is NaN


def e4m3_code(v: float) -> int:
    """Nearest e4m3 code of |v| <= 448, ties to the even code; the sign bit kept (-0.0 -> 0x80)."""
    a = abs(v)
    best = min(range(0x7F), key=lambda c: (abs(POSITIVE[c] - a), c & 1))
    return best | (0x80 if math.copysign(1.0, v) < 0 else 0)


def pow2_scale(values: list[float]) -> float:
    """2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), the product rounded to fp32 first."""
    t = f32(f32(max(max(abs(v) for v in values), 1e-4)) * f32(1 / 448))
    mant, exp = math.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    return 2.0 ** (exp - 1 if mant == 0.5 else exp)


def codes_of(values: list[float], scale: float) -> bytes:
    return bytes(e4m3_code(max(-448.0, min(448.0, v / scale))) for v in values)


def expected_kv_pool(num_pages: int, page: int, slots: list[int], rows: torch.Tensor) -> bytes:
    """The pool bytes after writing bf16 rows [N, 512] to slots (others untouched), laid out as
    FlashMLA's MODEL1 pages: [page*576 token data][page*8 scale bytes] per page."""
    width = page * 584
    out = bytearray([SENTINEL]) * (num_pages * width)
    for slot, row in zip(slots, rows.float().tolist(), strict=True):
        if not 0 <= slot < num_pages * page:
            continue
        base, t = (slot // page) * width, slot % page
        data = bytearray()
        scale_bytes = bytearray()
        for g in range(7):
            group = row[64 * g : 64 * g + 64]
            scale = pow2_scale(group)
            data += codes_of(group, scale)
            scale_bytes.append(int(math.log2(scale)) + 127)
        for v in row[448:]:  # bf16 = the high half of the fp32 bits (inputs are bf16)
            data += struct.pack("<f", v)[2:]
        out[base + t * 576 : base + t * 576 + 576] = data
        out[base + page * 576 + t * 8 : base + page * 576 + t * 8 + 8] = scale_bytes + b"\0"
    return bytes(out)


def expected_index_pool(num_pages: int, page: int, slots: list[int], keys: torch.Tensor) -> bytes:
    """Index-key pages: [page*Di e4m3 codes][page fp32 scales, little-endian]."""
    dim = keys.shape[1]
    width = page * (dim + 4)
    out = bytearray([SENTINEL]) * (num_pages * width)
    for slot, key in zip(slots, keys.float().tolist(), strict=True):
        if not 0 <= slot < num_pages * page:
            continue
        base, t = (slot // page) * width, slot % page
        scale = pow2_scale(key)
        out[base + t * dim : base + t * dim + dim] = codes_of(key, scale)
        out[base + page * dim + 4 * t : base + page * dim + 4 * t + 4] = struct.pack("<f", scale)
    return bytes(out)


def special_rows() -> torch.Tensor:
    """bf16 rows [4, 512] whose groups hit the edges of the format: an all-zero group (amax floor
    1e-4: scale 2^-22), amax 0.01 (the release's 2^-15, not FlashMLA test's floor 2^-13), amax
    exactly 56 = 448 * 2^-3 (scale 2^-3) and just above (2^-2), -0.0 and negatives, e4m3 ties at
    scale 1 (17 -> 16, 19 -> 20, 1.5 subnormal quanta -> 2), huge values, random RoPE values."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 512, generator=g) * 3
    rows[1, 0:64] = 0.0
    rows[1, 64:128] = torch.linspace(-0.01, 0.01, 64)
    rows[1, 128:192] = torch.linspace(-56.0, 50.0, 64)
    rows[1, 192:256] = torch.linspace(-40.0, 56.25, 64)
    rows[2, 0:64] = -rows[2, 0:64].abs()
    rows[2, 0] = -0.0
    rows[2, 64:128] = torch.tensor([448.0, 17.0, 19.0, 3 * 2.0**-10] * 16)
    rows[2, 128:192] = 1e30
    rows[3] *= 1e-3
    return rows.to(torch.bfloat16)


def sentinel_pool(num_pages: int, width: int) -> torch.Tensor:
    return torch.full((num_pages, width), SENTINEL, dtype=torch.uint8)


# ---- attention entries -------------------------------------------------------------------------


KV_SLOTS = [5, 0, 11, -1, 12, 7]  # P = 4, 3 pages: 12 is out of range, -1 is skipped


def kv_rows() -> torch.Tensor:
    rows = torch.randn(6, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rows[:4] = special_rows()
    return rows


@pytest.mark.parametrize(
    "store", [kv_quant.store_kv_reference, kv_quant.store_kv], ids=["reference", "triton"]
)
def test_kv_pages_hold_the_flashmla_model1_bytes(store):
    rows = kv_rows()
    pool = sentinel_pool(3, 4 * 584)
    store(pool, torch.tensor(KV_SLOTS, dtype=torch.int32), rows)
    want = expected_kv_pool(3, 4, KV_SLOTS, rows)
    got = bytes(pool.flatten().tolist())
    diff = [i for i in range(len(want)) if want[i] != got[i]]
    assert not diff, f"{len(diff)} bytes differ, first at {diff[:8]}"


def test_kv_special_groups_get_the_release_scales():
    """Read the scale bytes back through the views: the edges listed in special_rows."""
    pool = kv_quant.kv_pool(1, 4, "cpu")
    kv_quant.store_kv_reference(pool, torch.arange(4), special_rows())
    _, scales = kv_quant.kv_views(pool)
    exponents = scales[0].int() - 127  # [P, 8]
    assert exponents[1, :4].tolist() == [-22, -15, -3, -2]
    assert exponents[2, 1] == 0 and scales[0, :, 7].tolist() == [0, 0, 0, 0]  # pad bytes
    data, _ = kv_quant.kv_views(pool)
    assert data[0, 2, 0] == 0x80  # -0.0 keeps its sign
    assert data[0, 2, 65:68].view(torch.float8_e4m3fn).float().tolist() == [16.0, 20.0, 2**-8]


def test_kv_round_trip_error_and_scale_are_tight():
    g = torch.Generator().manual_seed(2)
    spread = torch.exp(4 * torch.randn(64, 8, 1, generator=g))  # a magnitude per group
    x = (torch.randn(64, 8, 64, generator=g) * spread).reshape(64, 512).to(torch.bfloat16)
    records = kv_quant.quantize_kv(x)
    back = kv_quant.dequantize_kv(records)
    xf = x.float()
    assert torch.equal(back[:, 448:], xf[:, 448:])  # RoPE values pass untouched
    scale = kernels.quant.ue8m0_to_float(records[:, 576:583]).repeat_interleave(64, 1)
    err = (back[:, :448] - xf[:, :448]).abs()
    bound = torch.maximum(xf[:, :448].abs() * 2.0**-4, scale * 2.0**-10)  # half an e4m3 step
    assert bool((err <= bound).all()), f"worst {(err / bound).max():.3f} of the bound"
    amax = xf[:, :448].abs().view(64, 7, 64).amax(-1)
    ratio = amax / scale[:, ::64]
    floored = amax < 1e-4  # these keep 2^-22
    assert bool(floored.any()) and bool((scale[:, ::64][floored] == 2.0**-22).all())
    fits = (ratio > 224) & (ratio <= 448)
    assert bool((fits | floored).all()), "the smallest power of two that fits"
    assert bool((records[:, 583] == 0).all())


def test_gather_kv_decodes_independently():
    """gather_kv against the bytes decoded here: e4m3 bit formula times 2^(byte - 127)."""
    rows = kv_rows()[:4]
    pool = kv_quant.kv_pool(2, 4, "cpu")
    kv_quant.store_kv_reference(pool, torch.tensor([6, 1, 3, 4]), rows)
    raw = pool.flatten().tolist()
    got = kv_quant.gather_kv(pool, torch.tensor([[6, 1], [3, 4]]))  # [2, 2, 512]
    for (i, j), slot in zip([(0, 0), (0, 1), (1, 0), (1, 1)], [6, 1, 3, 4], strict=True):
        base, t = (slot // 4) * 4 * 584, slot % 4
        data = raw[base + t * 576 : base + t * 576 + 576]
        scales = raw[base + 4 * 576 + t * 8 : base + 4 * 576 + t * 8 + 7]
        nope = [e4m3_value(data[c]) * 2.0 ** (scales[c // 64] - 127) for c in range(448)]
        rope = [
            struct.unpack("<f", b"\0\0" + bytes(data[c : c + 2]))[0] for c in range(448, 576, 2)
        ]
        assert got[i, j].tolist() == nope + rope


def test_dispatch_store_kv_fp8():
    rows, slots = kv_rows(), torch.tensor(KV_SLOTS)
    want = sentinel_pool(3, 4 * 584)
    kv_quant.store_kv_reference(want, slots, rows)
    pool = sentinel_pool(3, 4 * 584)
    kernels.store_kv_fp8(pool, slots, rows)  # CPU: the reference
    assert torch.equal(pool, want)
    pool = sentinel_pool(3, 4 * 584)
    with kernels.use_backend("triton"):
        kernels.store_kv_fp8(pool, slots.int(), rows.float())  # fp32 rows of bf16 values
    assert torch.equal(pool, want)


def test_kv_pool_shape_checks():
    rows = kv_rows()
    with pytest.raises(AssertionError, match="a token"):
        kv_quant.store_kv(torch.zeros(2, 1000, dtype=torch.uint8), torch.arange(6), rows)
    with pytest.raises(AssertionError, match="rows"):
        kv_quant.store_kv(kv_quant.kv_pool(2, 4, "cpu"), torch.arange(6), rows[:, :448])
    assert kv_quant.kv_page_size(kv_quant.kv_pool(3, 64, "cpu")) == 64


# ---- V3.2 latent rows -----------------------------------------------------------------------


def expected_v32_pool(num_pages: int, page: int, slots: list[int], rows: torch.Tensor) -> bytes:
    """The pool bytes after writing bf16 rows [N, 576] to slots (others untouched), laid out as
    FlashMLA's V3.2 pages: token t at t*656: 512 e4m3 codes, 4 fp32 scales, 64 bf16 values."""
    width = page * 656
    out = bytearray([SENTINEL]) * (num_pages * width)
    for slot, row in zip(slots, rows.float().tolist(), strict=True):
        if not 0 <= slot < num_pages * page:
            continue
        codes, scales = bytearray(), bytearray()
        for g in range(4):
            group = row[128 * g : 128 * g + 128]
            scale = pow2_scale(group)
            codes += codes_of(group, scale)
            scales += struct.pack("<f", scale)
        rope = b"".join(struct.pack("<f", v)[2:] for v in row[512:])
        at = (slot // page) * width + (slot % page) * 656
        out[at : at + 656] = codes + scales + rope
    return bytes(out)


def v32_rows() -> torch.Tensor:
    rows = torch.randn(6, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    rows[:4, :512] = special_rows()  # the edge groups, as halves of 128-value groups
    rows[1, :128] = 0.0  # a whole group at the amax floor
    return rows


@pytest.mark.parametrize(
    "store", [kv_quant.store_kv_v32_reference, kv_quant.store_kv_v32], ids=["reference", "triton"]
)
def test_v32_pages_hold_the_flashmla_v32_bytes(store):
    rows = v32_rows()
    pool = sentinel_pool(3, 4 * 656)
    store(pool, torch.tensor(KV_SLOTS, dtype=torch.int32), rows)
    want = expected_v32_pool(3, 4, KV_SLOTS, rows)
    got = bytes(pool.flatten().tolist())
    diff = [i for i in range(len(want)) if want[i] != got[i]]
    assert not diff, f"{len(diff)} bytes differ, first at {diff[:8]}"


def test_v32_round_trip_gather_and_dispatch():
    g = torch.Generator().manual_seed(5)
    spread = torch.exp(4 * torch.randn(16, 4, 1, generator=g))
    x = torch.randn(16, 576, generator=g)
    x[:, :512] = (x[:, :512].view(16, 4, 128) * spread).reshape(16, 512)
    x = x.to(torch.bfloat16)
    records = kv_quant.quantize_kv_v32(x)
    back, xf = kv_quant.dequantize_kv_v32(records), x.float()
    assert torch.equal(back[:, 512:], xf[:, 512:])  # RoPE values pass untouched
    scale = records[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, 1)
    err = (back[:, :512] - xf[:, :512]).abs()
    assert bool((err <= torch.maximum(xf[:, :512].abs() * 2.0**-4, scale * 2.0**-10)).all())
    # store_rows tells the formats apart by width: 656-byte pages of 576-wide rows
    pool = torch.zeros(4, 4 * 656, dtype=torch.uint8)
    slots = torch.randperm(16, generator=g)
    kernels.store_rows(pool, slots, x, page_size=4)
    assert torch.equal(kv_quant.gather_kv(pool, slots, 576), back)
    assert kv_quant.kv_token_bytes(576) == 656 and kv_quant.kv_page_size(pool, 576) == 4
    with pytest.raises(ValueError, match="no FP8 format for 192-wide"):
        kv_quant.kv_token_bytes(192)


# ---- index keys --------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [32, 128])
@pytest.mark.parametrize(
    "store",
    [kv_quant.store_index_k_reference, kv_quant.store_index_k],
    ids=["reference", "triton"],
)
def test_index_pages_hold_codes_then_fp32_scales(store, dim):
    g = torch.Generator().manual_seed(dim)
    keys = (torch.randn(6, dim, generator=g) * 5).to(torch.bfloat16)
    keys[1] = 0.0  # amax floor
    keys[2, :4] = torch.tensor([448.0, 17.0, 19.0, -0.0])  # scale 1: ties and a signed zero
    keys[2, 4:] = keys[2, 4:].clamp(-400, 400)
    pool = sentinel_pool(3, 4 * (dim + 4))
    store(pool, torch.tensor(KV_SLOTS), keys)
    assert bytes(pool.flatten().tolist()) == expected_index_pool(3, 4, KV_SLOTS, keys)
    assert kv_quant.index_token_bytes(128) == 132


def test_index_round_trip_and_gather():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(8, 128, generator=g) * torch.exp(3 * torch.randn(8, 1, generator=g))
    keys = keys.to(torch.bfloat16)
    records = kv_quant.quantize_index_k(keys)
    back = kv_quant.dequantize_index_k(records)
    scale = records[:, 128:].contiguous().view(torch.float32)  # [8, 1]
    err = (back - keys.float()).abs()
    assert bool((err <= torch.maximum(keys.float().abs() * 2.0**-4, scale * 2.0**-10)).all())
    ratio = keys.float().abs().amax(1, keepdim=True) / scale
    assert bool(((ratio > 224) & (ratio <= 448)).all())
    pool = kv_quant.index_pool(2, 4, 128, "cpu")
    kernels.store_index_k_fp8(pool, torch.tensor([7, 0, 2, 5, 1, 3, 4, 6]), keys)
    got = kv_quant.gather_index_k(pool, torch.tensor([0, 7]), 128)
    assert torch.equal(got, back[[1, 0]])


# ---- real shapes on CUDA -------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("dim", [512, 576], ids=["v4", "v32"])
def test_cuda_store_kv_matches_reference_and_captures(dim):
    """4096 rows into a 1M-slot pool (P = 64): bytes equal to the reference, also when replayed
    from a CUDA graph with new rows."""
    dev = "cuda"
    slots = torch.randperm(1 << 20, device=dev)[:4096]
    slots[::97] = -1
    rows = (torch.randn(4096, dim, device=dev) * 4).to(torch.bfloat16)
    width = 64 * kv_quant.kv_token_bytes(dim)
    want, pool = (torch.zeros(1 << 14, width, dtype=torch.uint8, device=dev) for _ in range(2))
    with kernels.use_backend("reference"):
        kernels.store_kv_fp8(want, slots, rows)
    kernels.store_kv_fp8(pool, slots, rows)  # compiles outside the capture
    assert torch.equal(pool, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.store_kv_fp8(pool, slots, rows)
    rows.copy_(torch.randn(4096, dim, device=dev).to(torch.bfloat16))
    graph.replay()
    with kernels.use_backend("reference"):
        kernels.store_kv_fp8(want, slots, rows)
    assert torch.equal(pool, want)


@gpu_test
def test_cuda_store_index_k_matches_reference():
    dev = "cuda"
    slots = torch.randperm(1 << 18, device=dev)[:4096].int()
    keys = (torch.randn(4096, 128, device=dev) * 3).to(torch.bfloat16)
    want, pool = kv_quant.index_pool(4096, 64, 128, dev), kv_quant.index_pool(4096, 64, 128, dev)
    kv_quant.store_index_k_reference(want, slots, keys)
    kernels.store_index_k_fp8(pool, slots, keys)
    assert torch.equal(pool, want)
