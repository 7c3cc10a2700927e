"""Data-parallel attention with expert parallelism on the CPU: two engines (processes over gloo),
each with its own requests, scheduler and KV pools, sharing the routed experts through
dispatch/combine all-to-alls, against one engine.

fp32: the pairs' expert outputs are summed in another order than one engine sums them, so the
logits agree within 1e-5 and the greedy tokens exactly. One process start serves every check:
requests of different lengths on each engine, then engine 1 idle (padded empty steps) while
engine 0 scores and generates.
"""

from __future__ import annotations

import pytest

from bench.compare import rel_err
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import byte_ids

pytestmark = pytest.mark.e2e  # two engines, each a process

ENGINE = dict(max_num_batched_tokens=37, page_size=8, kv_cache_memory_bytes=64 << 20)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


def _logprobs(results) -> list[float]:
    return [lp for r in results for t in r.logprobs for lp in (t.logprob, *t.top_logprobs)]


def test_two_engines_with_shared_experts_compute_what_one_computes(tiny):
    prompts = [byte_ids(n, n) for n in (9, 130, 40)]  # engine 0 takes 9 and 40, engine 1 130
    ids = byte_ids(300, 7)
    one = LLM(tiny, **ENGINE)
    want = one.generate(prompts, GREEDY)
    want_logits = one.score(ids)
    with LLM(tiny, data_parallel_size=2, enable_expert_parallel=True, **ENGINE) as two:
        engines = two.engine
        processes = engines._processes
        # engine 0 holds half the experts: dispatch/combine reached the other half
        moe = next(m for m in engines.local.model.modules() if hasattr(m, "expert_range"))
        assert moe.expert_range[1] - moe.expert_range[0] == one.engine.model_config.num_experts // 2
        got = two.generate(prompts, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert max(abs(a - b) for a, b in zip(_logprobs(got), _logprobs(want), strict=True)) < 1e-5
        # engine 1 idle: it runs padded empty steps while engine 0 computes
        assert rel_err(two.score(ids), want_logits) < 1e-5
        [alone] = two.generate(prompts[:1], GREEDY)
        assert alone.token_ids == want[0].token_ids
        # engine 0's pages came back (but those its prefix cache keeps)
        load = engines.local.load()
        assert load.free_pages + load.cached_pages == load.total_pages
    assert [p.exitcode for p in processes] == [0]  # stopped through the lockstep, not killed


def test_experts_that_do_not_split_over_the_ranks_are_refused(tiny):
    with pytest.raises(ValueError, match="routed experts do not split over the 3 ranks"):
        LLMEngine(tiny, EngineConfig(data_parallel_size=3, enable_expert_parallel=True))


def test_tensor_parallel_inside_each_data_parallel_rank_computes_what_one_computes(tiny):
    """DP=2 x TP=2: four processes; each engine's attention split over its two ranks, the routed
    experts over all four (a global rank's experts are its quarter)."""
    prompts = [byte_ids(n, n) for n in (21, 64)]
    want = LLM(tiny, **ENGINE).generate(prompts, GREEDY)
    config = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    with LLM(tiny, **config, **ENGINE) as four:
        moe = next(m for m in four.engine.local.model.modules() if hasattr(m, "expert_range"))
        experts = four.engine.local.model_config.num_experts
        assert moe.expert_range[1] - moe.expert_range[0] == experts // 4
        got = four.generate(prompts, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert max(abs(a - b) for a, b in zip(_logprobs(got), _logprobs(want), strict=True)) < 1e-5
