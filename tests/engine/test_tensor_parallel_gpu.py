"""Tensor parallelism on two GPUs (NCCL, CUDA graphs captured on both ranks) against one GPU.

fp32 runs the same kernels in both cases, so two ranks match one up to reordered fp32 sums.
bf16 rounds every op, and a random model amplifies any rounding difference (tests/
test_engine_gpu.py: bf16 drifts from fp32 by a few percent per layer), so there the yardstick is
bf16's own error: splitting may move the logits less than bf16 moves them from fp32. The
release-format model runs its FP8 GEMMs (wo_b keeping fp32 partial sums for the all-reduce) and
its FP4 experts (each rank its range) on the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.step import RowSpan
from tests.engine_cases import assert_all_free, byte_ids
from tests.release_reference import TOKENS, release_ids

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GPU = dict(device="cuda", kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "0123456789" * 20, "x"]
SEQ = 300


@pytest.mark.gpu
@two_gpus
def test_two_gpus_compute_what_one_computes_in_fp32(tiny):
    one = LLM(tiny, dtype="float32", **GPU)
    ids = byte_ids(SEQ, 0)
    want_logits, want_tokens = one.score(ids), [r.token_ids for r in one.generate(PROMPTS, GREEDY)]
    free_before = torch.cuda.mem_get_info(1)[0]
    with LLM(tiny, dtype="float32", tensor_parallel_size=2, **GPU) as two:
        # rank 1 lives on the second GPU: its KV pool alone takes 256 MiB there
        assert torch.cuda.mem_get_info(1)[0] < free_before - (256 << 20)
        assert rel_err(two.score(ids), want_logits) < 1e-4
        assert [r.token_ids for r in two.generate(PROMPTS, GREEDY)] == want_tokens


@pytest.mark.gpu
@two_gpus
def test_two_gpus_match_one_within_bf16s_own_error_and_replay_graphs(tiny):
    ids = byte_ids(SEQ, 1)
    exact = LLM(tiny, dtype="float32", **GPU).score(ids)
    one = LLM(tiny, dtype="bfloat16", **GPU).score(ids)
    with LLM(tiny, dtype="bfloat16", tensor_parallel_size=2, **GPU) as llm:
        assert rel_err(llm.score(ids), one) < rel_err(one, exact)
        engine = llm.engine
        assert engine.runner.graphs, "decode graphs should be captured on every rank"
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), llm.tokenizer.encode(p), GREEDY)
        engine.step()  # prefill all three
        reqs = [engine.scheduler.requests[str(i)] for i in range(3)]
        spans = [RowSpan(r.num_computed, 1, r.slab, r.tokens(r.num_computed, 1)) for r in reqs]
        # the same decode step (it rewrites the same KV), replayed on both ranks, then eager
        graphed = engine.runner.call("forward", spans, 3, [0, 1, 2]).clone()
        eager = engine.runner.call("forward", spans, 3, None)
        assert rel_err(graphed, eager) < 2e-2
        while engine.has_unfinished():
            engine.step()
        assert_all_free(engine)


@pytest.mark.gpu
@two_gpus
def test_two_gpus_run_the_release_formats_within_the_quantizations_own_error(release):
    ids = release_ids(SEQ, 2)
    exact = LLM(release, dtype="float32", **GPU).score(ids)  # dequantized at load
    one = LLM(release, dtype="bfloat16", **GPU)
    want, want_logits = one.generate(release_ids(40, 3), GREEDY)[0].token_ids, one.score(ids)
    with LLM(release, dtype="bfloat16", tensor_parallel_size=2, **GPU) as two:
        assert two.engine.model.quant is not None and two.engine.runner.graphs
        got = two.score(ids)
        top1 = (got[:, :TOKENS].argmax(-1) == want_logits[:, :TOKENS].argmax(-1)).float().mean()
        assert top1.item() > 0.75
        assert rel_err(got, want_logits) < rel_err(want_logits, exact)
        tokens = two.generate(release_ids(40, 3), GREEDY)[0].token_ids
        assert len(tokens) == len(want) and max(tokens) < TOKENS
