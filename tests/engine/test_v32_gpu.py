"""DeepSeek-V3.2 on a GPU (Triton kernels, CUDA graphs) against its own CPU path: fp32 on both
sides tests the GPU code path rather than bf16 rounding; graphs are checked against eager bf16 on
the same state; the FP8 KV cache against the model-dtype cache fed FP8 round-tripped rows.
(On the H200, 2026-12-04, second session: all three pass.)"""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.step import RowSpan
from tests.engine_cases import V32_WIDE, assert_all_free, byte_ids, fp8_round_trip
from tests.kernels_cases import gpu_test

GPU = dict(device="cuda", kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
# 16 heads: the Triton sparse-MLA kernel's tiles (a tiny model's 4 heads run the reference)
HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("v32_gpu"), overrides=HEADS)


@gpu_test
def test_gpu_engine_matches_the_cpu_engine_in_fp32(model):
    ids = byte_ids(300, 0)
    cpu, gpu = LLM(model), LLM(model, dtype="float32", **GPU)
    assert rel_err(gpu.score(ids), cpu.score(ids)) < 1e-3
    prompts = [byte_ids(n, n) for n in (3, 50, 200)]
    assert [r.token_ids for r in gpu.generate(prompts, GREEDY)] == [
        r.token_ids for r in cpu.generate(prompts, GREEDY)
    ]


@gpu_test
def test_graph_replayed_decode_equals_eager_decode_in_bf16(model):
    llm = LLM(model, dtype="bfloat16", **GPU)
    engine = llm.engine
    assert engine.runner.graphs, "decode graphs should be captured for bf16 on CUDA"
    for i, n in enumerate((5, 60, 130)):
        engine.add_request(str(i), byte_ids(n, i), SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # prefill all three
    reqs = [engine.scheduler.requests[str(i)] for i in range(3)]
    specs = [RowSpan(r.num_computed, 1, r.slab, r.tokens(r.num_computed, 1)) for r in reqs]
    graphed = engine.runner.forward(specs, 3, [0, 1, 2]).clone()
    eager = engine.runner.forward(specs, 3, None)
    assert rel_err(graphed, eager) < 2e-2
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


@gpu_test
def test_fp8_pages_on_the_gpu_compute_what_round_tripped_rows_compute(tmp_path, monkeypatch):
    """The Triton FP8 store and loaders at V3.2's widths (656-byte rows, FP8 index keys)."""
    wide = make_tiny_model(tmp_path, overrides={**V32_WIDE, **HEADS})
    sequence = byte_ids(120, 3)
    fp8 = LLM(wide, dtype="float32", kv_cache_dtype="fp8", **GPU).score(sequence)
    plain = LLM(wide, dtype="float32", **GPU)
    monkeypatch.setattr(
        kernels,
        "store_rows",
        lambda pool, slots, rows, _: pool.index_copy_(0, slots, fp8_round_trip(rows)),
    )
    torch.testing.assert_close(fp8, plain.score(sequence), rtol=0, atol=1e-3)
