"""The simulated engine (--simulate PROFILE): the cost model recovers the step times a profile
was made from, and the engine around the simulated model is the real one (requests run to
max_tokens, pages and prefix cache accounted, every page back)."""

from __future__ import annotations

import json

import pytest

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.simulate import CostModel

PROFILE = "bench/results/h200-engine-256.json"


def test_the_cost_model_recovers_the_profile_it_was_fitted_to(tmp_path):
    a, b, c = 4e-3, 3e-4, 2e-9
    rows = [
        {"concurrency": n, "context": ctx, "step_ms": 1e3 * (a + b * n + c * n * ctx)}
        for n in (1, 16, 64)
        for ctx in (4096, 32768)
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"decode": rows, "prefill_tok_s": {"2048": 1e4, "8192": 2e4}}))
    cost = CostModel.from_profile(path)
    assert cost.step_s(0, [1000, 3000]) == pytest.approx(a + 2 * b + 4000 * c, rel=1e-6)
    assert cost.step_s(500, []) == pytest.approx(500 / 2e4)
    assert CostModel.from_profile(PROFILE).prefill_tokens_per_s > 0  # the recorded H200 one


def test_a_simulated_engine_accounts_pages_and_runs_requests_to_max_tokens():
    with LLM(
        DEMO_MODEL_DIR,
        simulate=PROFILE,
        kv_cache_memory_bytes=160 << 20,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    ) as llm:
        shared = "To be, or not to be: " * 30
        results = llm.generate([shared + "a", shared + "b"], SamplingParams(max_tokens=20))
        assert [len(r.token_ids) for r in results] == [20, 20]
        assert {r.finish_reason for r in results} == {"length"}
        llm.generate([shared + "a"], SamplingParams(max_tokens=5))
        engine = llm.engine
        assert engine.prefix_cache is not None and engine.prefix_cache.stats.hits > 0
        load = engine.load()
        assert load.free_pages + load.cached_pages == load.total_pages
