"""sparse_mla_decode: Triton (interpreter on CPU, compiled on CUDA), naive and reference against
a float64 reference. CPU cases are tiny: the interpreter costs ~20 ms per program instance."""

from __future__ import annotations

import pytest
import torch

from bench import naive
from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.kernels import reference, sparse_mla
from dsaserve.kernels.sparse_mla import DecodeConfig
from tests.kernels_cases import decode_case, fp8_decode_case, gpu_test

# Tolerances (relative error): fp32 arithmetic lands far under 1e-5; bf16 operands of the PV
# product (p is rounded to bf16) land near 3e-3; lse comes from fp32 QK sums.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-4)}


def check(case, out, lse, dtype=torch.float32):
    ref_out, ref_lse = case.reference64()
    out_tol, lse_tol = TOL[dtype]
    assert out.dtype == case.q.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < out_tol
    assert rel_err(lse, ref_lse) < lse_tol
    empty = torch.isneginf(ref_lse)
    assert bool(empty.any()), "case should hold rows without a valid index"
    blank = out.cpu()[empty].float()
    assert torch.equal(blank, torch.zeros_like(blank))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("heads,dim", [(16, 512), (16, 576), (64, 512), (64, 576)])
def test_triton_matches_float64(heads, dim, num_splits):
    case = decode_case(4, heads, dim, 37, sinks=dim == 576, seed=heads + dim + num_splits)
    cfg = DecodeConfig(min(heads, 64), 16, num_splits, 4, 1)
    check(case, *case.run(lambda *a, **k: sparse_mla.sparse_mla_decode(*a, **k, config=cfg)))


def test_triton_long_index_list_gets_more_splits(monkeypatch):
    monkeypatch.setattr(sparse_mla, "IDX_CHUNK_MAX", 32)  # 150 entries: at least 5 splits
    case = decode_case(3, 16, 512, 150, seed=11)
    cfg = DecodeConfig(16, 16, 1, 4, 1)
    check(case, *case.run(lambda *a, **k: sparse_mla.sparse_mla_decode(*a, **k, config=cfg)))


@pytest.mark.parametrize("sinks", [False, True])
def test_triton_without_lengths_bf16(sinks):
    case = decode_case(3, 32, 576, 20, sinks=sinks, ragged=False, dtype=torch.bfloat16)
    cfg = DecodeConfig(16, 16, 2, 4, 1)  # two head tiles per row
    out, lse = case.run(lambda *a, **k: sparse_mla.sparse_mla_decode(*a, **k, config=cfg))
    check(case, out, lse, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, token_bytes", [(512, 584), (576, 656)], ids=["v4", "v32"])
def test_triton_fp8_pool_matches_float64_on_dequantized_rows(dtype, num_splits, dim, token_bytes):
    """The FP8 pool (4-slot pages, holes and out-of-range ids included) must give exactly the
    attention over its dequantized rows: the float64 yardstick reads those rows. V4's rows are
    K = V = 512 values; V3.2's 576, V their first 512."""
    fp8, dequantized = fp8_decode_case(decode_case(4, 16, dim, 37, dtype=dtype, seed=5), 4)
    assert fp8.kv.dtype == torch.uint8 and fp8.kv.shape == (75, 4 * token_bytes)
    cfg = DecodeConfig(16, 16, num_splits, 4, 1)
    out, lse = fp8.run(lambda *a, **k: sparse_mla.sparse_mla_decode(*a, **k, config=cfg))
    check(dequantized, out, lse, dtype)


def test_fp8_rows_are_not_the_bf16_rows():
    """The FP8 round trip moves the NoPE values (so the test above can tell the pools apart)
    and keeps the RoPE values."""
    case = decode_case(2, 16, 512, 9, dtype=torch.bfloat16)
    _, dequantized = fp8_decode_case(case, 4)
    moved = dequantized.kv[:, :448] != case.kv[:, :448].float()
    assert moved.float().mean() > 0.5
    assert torch.equal(dequantized.kv[:, 448:], case.kv[:, 448:].float())


@pytest.mark.parametrize("dim", [512, 576], ids=["v4", "v32"])
def test_reference_and_dispatch_read_fp8_pools(dim):
    fp8, dequantized = fp8_decode_case(decode_case(3, 16, dim, 21, seed=2), 4)
    out, lse = fp8.run(kernels.sparse_mla_decode)  # CPU: the reference
    check(dequantized, out, lse)
    with kernels.use_backend("triton"):
        check(dequantized, *fp8.run(kernels.sparse_mla_decode))
    with pytest.raises(AssertionError, match="plain pools"):
        fp8.run(naive.sparse_mla_decode)


def test_fp8_pool_shape_checks():
    fp8, _ = fp8_decode_case(decode_case(2, 16, 512, 9), 4)
    with pytest.raises(AssertionError, match="512-wide"):
        sparse_mla.sparse_mla_decode(fp8.q[..., :256], fp8.kv, fp8.indices, 0.1, d_v=256)
    with pytest.raises(AssertionError, match="a token"):
        sparse_mla.sparse_mla_decode(fp8.q, fp8.kv[:, :-8], fp8.indices, 0.1)
    v32, _ = fp8_decode_case(decode_case(2, 16, 576, 9), 4)
    with pytest.raises(AssertionError, match="2624 bytes a page, 584 a token"):  # V4 q, V3.2 pages
        sparse_mla.sparse_mla_decode(v32.q[..., :512], v32.kv, v32.indices, 0.1)


def test_naive_matches_float64():
    case = decode_case(3, 16, 576, 21)
    check(case, *case.run(naive.sparse_mla_decode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64(dtype):
    case = decode_case(5, 16, 576, 50, dtype=dtype)
    check(case, *case.run(reference.sparse_mla_decode), dtype)


def test_dispatch_picks_reference_on_cpu_and_can_be_forced():
    case = decode_case(2, 16, 512, 9)
    want = case.run(reference.sparse_mla_decode)
    assert all(
        torch.equal(a, b) for a, b in zip(case.run(kernels.sparse_mla_decode), want, strict=True)
    )
    with kernels.use_backend("reference"):
        with kernels.use_backend("triton"):
            out, _ = case.run(kernels.sparse_mla_decode)
        assert rel_err(out, want[0]) < 1e-5
    with naive.in_engine():  # a benchmark's "before" kernels, swapped in
        swapped = case.run(kernels.sparse_mla_decode)
    assert all(
        torch.equal(a, b) for a, b in zip(swapped, case.run(naive.sparse_mla_decode), strict=True)
    )
    assert all(
        torch.equal(a, b) for a, b in zip(case.run(kernels.sparse_mla_decode), want, strict=True)
    )


def test_default_config_follows_shapes_only():
    dev = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert sparse_mla.default_config(1, 64, 640, dev).num_splits > 1
    assert sparse_mla.default_config(4096, 64, 640, dev).num_splits == 1  # prefill rows
    assert sparse_mla.default_config(1, 64, 100, dev).num_splits == 1  # too few entries
    assert sparse_mla.default_config(2, 48, 640, dev).block_h == 16


# ---- real shapes on CUDA -------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize(
    "batch,heads,dim,num_idx",
    [
        (1, 64, 512, 640),
        (64, 64, 512, 640),
        (16, 128, 576, 2048),
        (2048, 64, 512, 640),
    ],
    ids=["v4-b1", "v4-b64", "v32-b16", "prefill-rows"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_real_shapes(batch, heads, dim, num_idx, dtype):
    case = decode_case(batch, heads, dim, num_idx, slots=1 << 20, dtype=dtype, device="cuda")
    check(case, *case.run(kernels.sparse_mla_decode), dtype)


@gpu_test
@pytest.mark.parametrize("batch", [1, 64, 2048], ids=["b1", "b64", "prefill-rows"])
@pytest.mark.parametrize("shape", [(64, 512, 640), (128, 576, 2048)], ids=["v4", "v32"])
def test_cuda_fp8_pool_real_shapes(batch, shape):
    """(heads, row width, index list): V4-Flash's 584-byte rows, V3.2's 656-byte ones."""
    heads, dim, num_idx = shape
    case = decode_case(
        batch, heads, dim, num_idx, slots=1 << 20, dtype=torch.bfloat16, device="cuda"
    )
    fp8, dequantized = fp8_decode_case(case, 64)
    check(dequantized, *fp8.run(kernels.sparse_mla_decode), torch.bfloat16)


@gpu_test
def test_cuda_graph_replay_follows_new_inputs():
    """No host sync: the call captures into a graph, and replays read the new lengths."""
    case = decode_case(8, 64, 512, 640, slots=1 << 16, dtype=torch.bfloat16, device="cuda")
    case.run(kernels.sparse_mla_decode)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = case.run(kernels.sparse_mla_decode)
    case.lengths.copy_(torch.randint(0, 641, (8,), device="cuda", dtype=torch.int32))
    case.indices.copy_(torch.randint(-1, 1 << 16, (8, 640), device="cuda", dtype=torch.int32))
    graph.replay()
    want_out, want_lse = case.run(kernels.sparse_mla_decode)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
