"""The engine on a GPU (Triton kernels, CUDA graphs), against its own CPU path, for each family
(DeepSeek-V4 and DeepSeek-V3.2).

The CPU comparisons run fp32 on both sides, so they test the GPU code path rather than
bf16 rounding: on a random model bf16 drifts from fp32 by a few percent per layer whichever
kernels run (measured on an H200: 8% after six layers with Triton, 8% with the reference
kernels). CUDA graphs are captured for bf16 (torch's grouped GEMM of other dtypes syncs with
the host on CUDA), and are checked against eager bf16 on the same state. The release-format
tiny V4 model runs its FP8/FP4 layers on the Triton kernels, held to the release's arithmetic;
the demo model runs with the FP8 KV cache against the bf16 cache (not yet run on a GPU); V3.2's
FP8 KV cache (656-byte rows, FP8 index keys) against the model-dtype cache fed FP8 round-tripped
rows. (V3.2 on the H200, 2026-12-04, second session: its three cases passed.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.step import RowSpan
from tests.engine_cases import V32_WIDE, assert_all_free, byte_ids, fp8_round_trip
from tests.kernels_cases import gpu_test
from tests.model_fixtures import families
from tests.release_reference import (
    ENGINE,
    TOKENS,
    assert_layers_compute_the_release,
    read_checkpoint,
    release_ids,
)

GPU = dict(device="cuda", kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "0123456789" * 20, "x"]
# V3.2: 16 heads, the Triton sparse-MLA kernel's tiles (a tiny model's 4 heads run the reference)
V32_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16}


@dataclass(frozen=True)
class Case:
    overrides: dict  # config.json fields the GPU kernels need of the tiny model
    ids: list[int]  # scored on both engines
    prompts: list  # decoded greedily on both engines (text or token ids)
    max_tokens: int
    graph_prompts: Callable[[LLM], list[list[int]]]  # one graph-replayed decode step


CASES = {
    "deepseek_v4": Case(
        overrides={},
        ids=torch.randint(0, 262, (300,), generator=torch.Generator().manual_seed(0)).tolist(),
        prompts=PROMPTS,
        max_tokens=40,
        graph_prompts=lambda llm: [llm.tokenizer.encode(p) for p in PROMPTS],
    ),
    "deepseek_v32": Case(
        overrides=V32_HEADS,
        ids=byte_ids(300, 0),
        prompts=[byte_ids(n, n) for n in (3, 50, 200)],
        max_tokens=32,
        graph_prompts=lambda llm: [byte_ids(n, i) for i, n in enumerate((5, 60, 130))],
    ),
}


@pytest.fixture(scope="module")
def model(family, tmp_path_factory):
    """The family's tiny dense checkpoint at the widths the GPU kernels take."""
    overrides = CASES[family.name].overrides
    return family.make_tiny_model(tmp_path_factory.mktemp(f"gpu-{family}"), overrides=overrides)


@gpu_test
@families()
def test_gpu_engine_matches_the_cpu_engine_in_fp32(family, model):
    case = CASES[family.name]
    greedy = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
    cpu, gpu = LLM(model), LLM(model, dtype="float32", **GPU)
    assert rel_err(gpu.score(case.ids), cpu.score(case.ids)) < 1e-3
    assert [r.token_ids for r in gpu.generate(case.prompts, greedy)] == [
        r.token_ids for r in cpu.generate(case.prompts, greedy)
    ]


@gpu_test
@families()
def test_graph_replayed_decode_equals_eager_decode_in_bf16(family, model):
    case = CASES[family.name]
    llm = LLM(model, dtype="bfloat16", **GPU)
    engine = llm.engine
    assert engine.runner.graphs, "decode graphs should be captured for bf16 on CUDA"
    for i, prompt in enumerate(case.graph_prompts(llm)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # prefill all three (their first tokens stay on the device: async scheduling)
    reqs = [engine.scheduler.requests[str(i)] for i in range(3)]
    specs = [RowSpan(r.num_computed, 1, r.slab, r.tokens(r.num_computed, 1)) for r in reqs]
    # the same decode step (it rewrites the same KV), replayed, then eager
    graphed = engine.runner.forward(specs, 3, [0, 1, 2]).clone()
    eager = engine.runner.forward(specs, 3, None)
    assert rel_err(graphed, eager) < 2e-2
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)
    greedy = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
    assert all(len(r.token_ids) == case.max_tokens for r in llm.generate(case.prompts, greedy))


# ---------------------------------------------------------------- DeepSeek-V4's own


@gpu_test
def test_demo_model_numerics_on_the_gpu_path():
    """The numerics probe (bench/numerics.py) on the trained demo model: the bf16 GPU path with
    the Triton kernels forced (a fallback would fail) against the fp32 CPU path."""
    from bench.numerics import probe

    result = probe(windows=8, prompts=4, steps=256)
    assert result["decode_graph_batch_sizes"], "decode steps must replay CUDA graphs"
    assert result["bpb_rel_diff"] < 0.01, result
    # Free-running greedy continuations part for good after a first near-tie flips one token
    # (0.55 agreement over 8 x 256 steps on the H200): the per-step check is teacher-forced.
    assert result["teacher_forced_agreement"] >= 0.95, result


@gpu_test
@families("deepseek_v4")
def test_quantized_layers_on_the_gpu_compute_the_release_arithmetic(release):
    """The Triton kernels (act_quant, the FP8 GEMM with and without fused quantization, the
    FP4 MoE), eager so that the hooks see every step."""
    llm = LLM(release, device="cuda", dtype="bfloat16", enforce_eager=True, **ENGINE)
    assert_layers_compute_the_release(llm, read_checkpoint(release))


@gpu_test
@families("deepseek_v4")
def test_graph_replayed_quantized_decode_never_samples_padded_ids(release):
    """bf16 decode steps of the quantized model replay CUDA graphs whose logits live in the
    graph's own output buffer: the padded-vocabulary mask writes into it."""
    llm = LLM(release, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
    assert llm.engine.runner.graphs and llm.engine.model.quant is not None
    sampled = SamplingParams(max_tokens=48, temperature=1.0, seed=5, ignore_eos=True)
    for res in llm.generate([release_ids(4, 0), release_ids(200, 1)], sampled):
        assert len(res.token_ids) == 48 and max(res.token_ids) < TOKENS


@gpu_test
def test_fp8_kv_cache_on_the_gpu_tracks_the_model_dtype_cache():
    """--kv-cache-dtype fp8 on the GPU path (Triton quantize-on-write, the decode and indexer
    kernels' dequantizing loaders, CUDA graphs), the Triton kernels forced: the demo model's
    held-out bits per byte stay within 1% of the bf16 cache's (0.02% on the CPU in fp32), and
    graph-replayed decode runs to its end and gives every page back."""
    from bench.numerics import BOS, bits_per_byte, heldout_windows
    from dsaserve.engine.demo_model import DEMO_MODEL_DIR

    texts, starts = heldout_windows(4), [[BOS, *w[:64]] for w in heldout_windows(3, 256)]
    bpb = {}
    with kernels.use_backend("triton"):  # no silent fallback to the reference kernels
        for cache in ("auto", "fp8"):
            llm = LLM(
                DEMO_MODEL_DIR,
                dtype="bfloat16",
                kv_cache_dtype=cache,
                max_num_batched_tokens=128,  # later prefill chunks read the cached pages
                **GPU,
            )
            bpb[cache] = bits_per_byte(llm.score, texts)
            assert llm.engine.runner.graphs, "decode steps must replay CUDA graphs"
            results = llm.generate(starts, GREEDY)
            assert all(len(r.token_ids) == GREEDY.max_tokens for r in results)
            assert_all_free(llm.engine)
    assert abs(bpb["fp8"] - bpb["auto"]) / bpb["auto"] < 0.01, bpb


# ---------------------------------------------------------------- DeepSeek-V3.2's own


@gpu_test
@families("deepseek_v32")
def test_fp8_pages_on_the_gpu_compute_what_round_tripped_rows_compute(
    family, tmp_path, monkeypatch
):
    """The Triton FP8 store and loaders at V3.2's widths (656-byte rows, FP8 index keys)."""
    wide = family.make_tiny_model(tmp_path, overrides={**V32_WIDE, **V32_HEADS})
    sequence = byte_ids(120, 3)
    fp8 = LLM(wide, dtype="float32", kv_cache_dtype="fp8", **GPU).score(sequence)
    plain = LLM(wide, dtype="float32", **GPU)
    monkeypatch.setattr(
        kernels,
        "store_rows",
        lambda pool, slots, rows, _: pool.index_copy_(0, slots, fp8_round_trip(rows)),
    )
    torch.testing.assert_close(fp8, plain.score(sequence), rtol=0, atol=1e-3)
