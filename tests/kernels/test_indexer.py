"""indexer_topk and positions_to_slots: Triton (interpreter on CPU, compiled on CUDA), naive and
reference against float64 scores. CPU cases are tiny; topk = 8 with 16-entry tiles makes the
score programs cut their candidates to the top-k several times per row."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench import naive
from dsaserve import kernels
from dsaserve.kernels import indexer, reference
from dsaserve.kernels.indexer import IndexerConfig
from dsaserve.kernels.quant import act_quant_reference, ue8m0_to_float
from tests.kernels_cases import (
    IndexerCase,
    check_topk,
    fp8_indexer_case,
    gpu_test,
    indexer_case,
)

TOPK = 8
LENGTHS = [0, 1, TOPK - 1, TOPK, TOPK + 1, 37, 100, 5]  # ragged, incl. 0 and the topk edge


@pytest.mark.parametrize(
    "num_splits,prefetch", [(1, True), (3, True), (3, False)], ids=["s1", "s3", "s3-no-prefetch"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_picks_the_top_scores(num_splits, prefetch, dtype):
    case = indexer_case(LENGTHS, topk=TOPK, dtype=dtype, seed=num_splits)
    cfg = IndexerConfig(16, num_splits, 16, 32, 4, 1, prefetch)
    idx = case.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg))
    check_topk(idx, case, 1e-6 if dtype == torch.float32 else 1e-5)


@pytest.mark.parametrize("num_splits,prefetch", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_keys_pick_the_top_scores_of_the_dequantized_keys(num_splits, prefetch, dtype):
    fp8, dequantized = fp8_indexer_case(indexer_case(LENGTHS, topk=TOPK, dtype=dtype, seed=4))
    assert fp8.k_cache.dtype == torch.uint8 and fp8.k_cache.shape[1] == 4 * (32 + 4)
    cfg = IndexerConfig(16, num_splits, 16, 32, 4, 1, prefetch)
    idx = fp8.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg))
    check_topk(idx, dequantized, 1e-6 if dtype == torch.float32 else 1e-5)


def rounded_queries(case: IndexerCase) -> IndexerCase:
    """The case with its queries through the release's act_quant (per head row, e4m3 codes times a
    power-of-two scale), as the fp8_dot kernel quantizes them."""
    codes, scale = act_quant_reference(case.q, block=case.q.shape[-1])
    return replace(case, q=codes.float() * ue8m0_to_float(scale))


FP8_DOT_LENGTHS = [0, 5, 37, 100, 200]  # seed 3: the rounding swaps one top-8 pick per long row


@pytest.mark.parametrize("num_splits,stages", [(1, 0), (3, 0), (3, 2)], ids=["s1", "s3", "s3-st2"])
@pytest.mark.parametrize("key_rows", [False, True], ids=["heads-m", "keys-m"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_dot_picks_the_top_scores_of_the_rounded_queries(
    num_splits, stages, key_rows, dtype
):
    """Exact against the float64 scores of e4m3-rounded queries and dequantized keys. Against the
    unrounded queries the rounding moves each score by at most eps (measured: ~3-6% of the row's
    largest score at Di = 32; each q value moves by at most 2^-4 of itself, e4m3's half ulp), so
    the r-th pick's score is within 2 eps of the r-th best score, and most picks are the same."""
    case = indexer_case(FP8_DOT_LENGTHS, topk=TOPK, dtype=dtype, seed=3)
    fp8, dequantized = fp8_indexer_case(case)
    cfg = IndexerConfig(16, num_splits, 16, 32, 4, 1, fp8_dot=True, key_rows=key_rows,
                        stages=stages)  # fmt: skip
    idx = fp8.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg))
    rounded = rounded_queries(dequantized)
    check_topk(idx, rounded, 1e-5)
    scores, moved = dequantized.scores64(), rounded.scores64()
    for b, n in enumerate(FP8_DOT_LENGTHS):
        if n > TOPK:
            eps = (moved[b, :n] - scores[b, :n]).abs().max()
            want = scores[b, :n].topk(TOPK)
            got = scores[b, idx[b].long()].sort(descending=True).values
            assert (want.values - got).abs().max() <= 2 * eps, b
            assert len(set(idx[b].tolist()) & set(want.indices.tolist())) >= TOPK - 2, b


def test_rounded_queries_change_the_ranking():
    """So the exact check above fails for a kernel that scores the unrounded queries."""
    _, dequantized = fp8_indexer_case(indexer_case(FP8_DOT_LENGTHS, topk=TOPK, seed=3))
    want = dequantized.scores64().topk(TOPK).indices
    assert not torch.equal(rounded_queries(dequantized).scores64().topk(TOPK).indices, want)


def test_fp8_dot_needs_an_fp8_pool():
    case = indexer_case([20], topk=TOPK)
    cfg = IndexerConfig(16, 1, 16, 32, 4, 1, fp8_dot=True)
    with pytest.raises(ValueError, match="FP8 key pools"):
        case.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg))


LOOP_VARIANTS = {  # IndexerConfig fields beside block_n 16, room 16, select_block 32, 4 warps
    "st2": dict(num_splits=3, stages=2),
    "st3-keys-m-cut": dict(num_splits=3, stages=3, key_rows=True, final_cut=True),
    "keys-m-cut": dict(num_splits=3, key_rows=True, final_cut=True),
    "groups-of-2": dict(num_splits=5, merge_group=2, max_regs=128),  # groups of 2, 2 and 1
    "groups-cut": dict(num_splits=4, merge_group=3, final_cut=True),
}


@pytest.mark.parametrize("variant", LOOP_VARIANTS.values(), ids=LOOP_VARIANTS.keys())
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-keys"])
def test_triton_loop_variants_pick_the_top_scores(variant, fp8):
    """Pipelined runs (cut between runs), keys on the MMA's M side, the final cut and the
    two-level merge are the same selection: row 100 with 16-entry tiles and room 16 cuts several
    times a split."""
    case = indexer_case(LENGTHS, topk=TOPK, dtype=torch.bfloat16, seed=8)
    if fp8:
        case, expected = fp8_indexer_case(case)
    else:
        expected = case
    cfg = IndexerConfig(16, room=16, select_block=32, num_warps=4, num_stages=1, **variant)
    check_topk(case.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg)), expected, 1e-5)


def test_context_splits_fill_one_wave_and_keep_min_tiles():
    dev = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert indexer.context_splits(1, 1 << 18, dev) == 4
    assert indexer.context_splits(1, 1 << 18, dev, programs_per_sm=2) == 8
    assert indexer.context_splits(3, 1 << 18, dev) == 1  # 3 x 2 would be a second, partial wave
    assert indexer.context_splits(1, 2048, dev, min_tiles=8, block_n=128) == 2
    assert indexer.context_splits(1, 100, dev) == 1
    cfg = indexer.context_config(1, 1 << 18, dev, programs_per_sm=2)
    assert (cfg.num_splits, cfg.merge_group, cfg.max_regs, cfg.final_cut) == (8, 2, 128, True)


def test_fp8_keys_change_the_ranking():
    """The FP8 round trip moves scores enough to reorder entries, so a kernel reading the
    original keys would fail the test above."""
    case = indexer_case([100], topk=TOPK, seed=4)
    _, dequantized = fp8_indexer_case(case)
    assert not torch.equal(case.scores64().argsort(), dequantized.scores64().argsort())


@pytest.mark.parametrize(
    "impl",
    [reference.indexer_topk, naive.indexer_topk, kernels.indexer_topk],
    ids=["reference", "naive", "dispatch"],
)
def test_torch_versions_read_fp8_keys(impl):
    fp8, dequantized = fp8_indexer_case(indexer_case(LENGTHS, topk=TOPK, max_pages=30, seed=6))
    check_topk(fp8.run(impl), dequantized, 1e-6)


def test_triton_ties_and_negative_scores():
    """All-zero weights tie every entry; negative weights give negative scores (key order)."""
    case = indexer_case([60, 45, 50], topk=TOPK, page_size=8, seed=3)
    case.weights[0] = 0.0
    case.weights[1] = -case.weights[1].abs()
    idx = case.run(
        lambda *a, **k: indexer.indexer_topk(*a, **k, config=IndexerConfig(16, 2, 16, 16, 4, 1))
    )
    check_topk(idx, case, 1e-6)


def test_triton_ignores_table_entries_past_the_length():
    """Entries past a row's length may point at pages that do not exist: never read."""
    case = indexer_case([20, 3], topk=TOPK, max_pages=64)
    case.page_table[:, 6:] = 1 << 30
    check_topk(case.run(indexer.indexer_topk), case, 1e-6)


@pytest.mark.parametrize(
    "impl", [reference.indexer_topk, naive.indexer_topk], ids=["reference", "naive"]
)
def test_torch_versions_pick_the_top_scores(impl):
    case = indexer_case(LENGTHS, topk=TOPK, max_pages=30, seed=7)
    check_topk(case.run(impl), case, 1e-6)


def test_dispatch_picks_reference_on_cpu_and_can_be_forced():
    case = indexer_case([3, 30], topk=TOPK)
    assert torch.equal(case.run(kernels.indexer_topk), case.run(reference.indexer_topk))
    with kernels.use_backend("triton"):
        check_topk(case.run(kernels.indexer_topk), case, 1e-6)


def test_positions_to_slots_maps_through_the_table():
    table = torch.tensor([[5, 2, 9], [1, 0, 3]], dtype=torch.int32)
    pos = torch.tensor([[0, 3, 4, 11, -1], [-1, -1, 7, 8, 2]], dtype=torch.int32)
    want = torch.tensor([[20, 23, 8, 39, -1], [-1, -1, 3, 12, 6]], dtype=torch.int32)
    assert torch.equal(kernels.positions_to_slots(pos, table, 4), want)


def test_configs_depend_on_shapes_only():
    dev = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert indexer.shape_config(1, dev).num_splits == 8
    assert indexer.shape_config(4096, dev).num_splits == 1
    lone, many = indexer.default_config(1, 1 << 20, dev), indexer.default_config(8, 1 << 20, dev)
    assert (lone.num_splits, lone.stages, lone.key_rows) == (4, 0, True)  # one program per SM
    assert (many.num_splits, many.stages, many.max_regs) == (1, 3, 128)  # two per SM, pipelined
    assert indexer.default_config(1, 2048, dev).num_splits == 2  # >= 8 tiles a split


# ---- real shapes on CUDA -------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_real_shapes(dtype):
    lengths = [0, 100, 512, 513, 3000, 8192, 20000, 65536]
    case = indexer_case(
        lengths,
        topk=512,
        heads=64,
        head_dim=128,
        page_size=64,
        dtype=dtype,
        device="cuda",
        max_pages=4096,
    )
    check_topk(case.run(kernels.indexer_topk), case, 1e-6 if dtype == torch.float32 else 1e-3)


def _real_fp8_cases():
    """V4-Flash's indexer shapes over lengths from empty to 64K: an FP8 pool and the bf16 case
    holding its dequantized keys."""
    lengths = [0, 100, 512, 513, 3000, 8192, 20000, 65536]
    case = indexer_case(
        lengths,
        topk=512,
        heads=64,
        head_dim=128,
        page_size=64,
        dtype=torch.bfloat16,
        device="cuda",
        max_pages=4096,
    )
    return fp8_indexer_case(case)


@gpu_test
def test_cuda_fp8_keys_real_shapes():
    fp8, dequantized = _real_fp8_cases()
    check_topk(fp8.run(kernels.indexer_topk), dequantized, 1e-3)


@gpu_test
def test_cuda_graph_replay_follows_new_lengths():
    case = indexer_case(
        [700, 5000, 9000, 200],
        topk=512,
        heads=64,
        head_dim=128,
        page_size=64,
        dtype=torch.bfloat16,
        device="cuda",
        max_pages=256,
    )
    case.run(kernels.indexer_topk)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = case.run(kernels.indexer_topk)
    case.lengths.copy_(torch.tensor([16000, 300, 513, 9999], dtype=torch.int32))
    graph.replay()
    check_topk(idx, case, 1e-3)


@gpu_test
@pytest.mark.parametrize("programs_per_sm", [1, 2])
def test_cuda_fp8_dot_with_context_config_real_shapes(programs_per_sm):
    fp8, dequantized = _real_fp8_cases()
    cfg = indexer.context_config(8, 4096 * 64, fp8.q.device, programs_per_sm=programs_per_sm)
    cfg = replace(cfg, stages=3, fp8_dot=True)
    idx = fp8.run(lambda *a, **k: indexer.indexer_topk(*a, **k, config=cfg))
    check_topk(idx, rounded_queries(dequantized), 1e-3)
