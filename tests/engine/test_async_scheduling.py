"""Async scheduling (LLMEngine): step N+1 is scheduled and launched before step N's ids reach
the host, and its decode rows read them on the device. It must answer exactly as waiting for
every step does, whatever the batch goes through (chunked prefill, preemption, stops, aborts,
seeded sampling, logprobs), and free everything."""

from __future__ import annotations

import pytest

from bench.async_scheduling import measure
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.request import RequestOutput, Status
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import PROMPTS as ENGINE_PROMPTS
from tests.engine_cases import assert_all_free, drain

PROMPTS = [*ENGINE_PROMPTS, "Hello there"]
ROOMY = dict(max_num_batched_tokens=512)
# ~2 requests' KV: requests queue and are preempted while their tokens are in flight
TIGHT = dict(kv_cache_memory_bytes=800_000, page_size=4, max_num_seqs=8, max_num_batched_tokens=32)
CHUNKED = dict(max_num_batched_tokens=7)
# a prefill-only request whose first token never ends it (the tests check its finish reason)
HELD = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_text(tiny) -> list[list[int]]:
    """Each prompt's greedy continuation (sync engine): where to put stop tokens."""
    engine = LLMEngine(tiny, EngineConfig(async_scheduling=False, **ROOMY))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate(_ids(engine)):
        engine.add_request(str(i), p, params)
    outs = drain(engine)
    return [[t for o in outs[str(i)] for t in o.new_token_ids] for i in range(len(PROMPTS))]


def _ids(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]


def _mixed_params(greedy_text: list[list[int]]) -> list[SamplingParams]:
    """Greedy and seeded requests that end by length, by a stop token early and late, by a
    stop string, with and without logprobs."""
    return [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[greedy_text[2][3]]),
        SamplingParams(
            max_tokens=25, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True, stop=["\x00never", "zq", "e t"]
        ),
        SamplingParams(max_tokens=30, temperature=1.2, seed=11, logprobs=1, ignore_eos=True),
    ]


def _run(tiny, options: dict, async_scheduling: bool, params) -> dict[str, list]:
    """Each request's outputs: (ids, text, finished, reason) and its logprobs as flat floats
    (the extra row of a stopped request changes later batches' shapes, so fp32 sums may
    differ in their last bits)."""
    engine = LLMEngine(tiny, EngineConfig(async_scheduling=async_scheduling, **options))
    for i, (p, sp) in enumerate(zip(_ids(engine), params, strict=True)):
        engine.add_request(str(i), p, sp)
    outputs = drain(engine)
    assert_all_free(engine)
    return {
        rid: [
            (
                (o.new_token_ids, o.text, o.finished, o.finish_reason),
                [(lp.top_ids, [lp.logprob, *lp.top_logprobs]) for lp in o.logprobs or []],
            )
            for o in outs
        ]
        for rid, outs in outputs.items()
    }


@pytest.mark.parametrize("options", [ROOMY, TIGHT, CHUNKED], ids=["roomy", "tight", "chunked"])
def test_async_scheduling_answers_exactly_as_waiting_for_every_step(tiny, greedy_text, options):
    params = _mixed_params(greedy_text)
    waited = _run(tiny, options, False, params)
    assert waited["2"][-1][0][3] == "stop"  # the stop token ended it early
    got = _run(tiny, options, True, params)
    assert got.keys() == waited.keys()
    for rid in waited:
        assert [o[0] for o in got[rid]] == [o[0] for o in waited[rid]], rid
        for (_, lps), (_, want) in zip(got[rid], waited[rid], strict=True):
            assert [ids for ids, _ in lps] == [ids for ids, _ in want]
            for (_, values), (_, expected) in zip(lps, want, strict=True):
                assert values == pytest.approx(expected, abs=1e-5)


def test_a_stopped_request_computes_one_row_more_and_sends_nothing_after_its_end(tiny, greedy_text):
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    prompt = _ids(engine)[0]
    stop = greedy_text[0][4]
    engine.add_request(
        "s",
        prompt,
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
    )
    req = engine.scheduler.requests["s"]
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs += engine.step()
    end = greedy_text[0].index(stop)
    assert [t for o in outs for t in o.new_token_ids] == greedy_text[0][: end + 1]
    # the step after the stopping token's was already launched for it: one more row
    assert req.status is Status.FINISHED and req.num_inflight == 1
    assert engine.has_unfinished() and engine.step() == [] and not engine.has_unfinished()
    assert_all_free(engine)


def test_aborting_a_request_whose_token_is_in_flight_drops_that_token(tiny):
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    engine.add_request("a", list(range(30)), SamplingParams(max_tokens=20, temperature=0))
    engine.add_request("b", list(range(40)), SamplingParams(max_tokens=20, temperature=0))
    got: dict[str, int] = {"a": 0, "b": 0}
    for _ in range(4):
        for out in engine.step():
            got[out.request_id] += len(out.new_token_ids)
    assert engine.scheduler.requests["a"].num_inflight == 1
    assert engine.abort("a")
    rest = drain(engine)
    assert "a" not in rest and got["a"] == 3  # its in-flight 4th token never came out
    assert sum(len(o.new_token_ids) for o in rest["b"]) + got["b"] == 20
    assert_all_free(engine)


def test_a_prefill_only_request_is_held_from_its_launch(tiny):
    """Held at launch (no later step may touch its KV); its token comes out at the next step,
    and the KV stays until its reader releases it (the lease is the worker's lease table's)."""
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    engine.add_request("p", list(range(40)), HELD, prefill_only=True)
    assert engine.step() == []  # launched: the token is still on the device
    assert engine.load().held == 1
    [out] = engine.step()
    assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
    assert engine.handoff.held_pages("p").num_tokens == 40
    assert engine.step() == [] and engine.load().held == 1  # nothing frees it but a release
    assert engine.handoff.release("p") and not engine.handoff.release("p")
    assert_all_free(engine)
    assert not engine.has_unfinished()


def test_a_held_request_staged_before_its_token_lands_keeps_its_blocks(tiny):
    """Between launch and completion a prefill-only request is already held: a stage then is
    kept (the staged blocks freed if the token ends it)."""
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    free_blocks = engine.pool.staging.allocator.num_free
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("ends", list(range(40)), one, prefill_only=True)
    engine.add_request("read", list(range(30)), HELD, prefill_only=True)
    assert engine.step() == []  # both launched, held, tokens in flight
    assert "staging" in engine.handoff.stage("ends").pages
    outs = {o.request_id: o for o in engine.step()}
    assert outs["ends"].finish_reason == "length" and outs["read"].finish_reason is None
    assert engine.pool.staging.allocator.num_free == free_blocks  # its blocks came back
    assert engine.handoff.held_pages("read").num_tokens == 30
    assert engine.handoff.release("read")
    assert_all_free(engine)
    assert not engine.has_unfinished()


def test_scoring_after_a_stopped_generation_finds_the_engine_idle(tiny, greedy_text):
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    prompt = _ids(engine)[0]
    engine.add_request(
        "s",
        prompt,
        SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[greedy_text[0][2]]
        ),
    )
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs += engine.step()
    assert engine.has_unfinished()  # the row after the stop is still in flight
    assert engine.score(prompt).shape[0] == len(prompt)
    assert_all_free(engine)
    assert not engine.has_unfinished()


def test_the_bench_times_both_modes_and_leaves_the_engine_idle(tiny):
    engine = LLMEngine(tiny, EngineConfig(**ROOMY))
    row = measure(engine, concurrency=2, context=40, steps=2, floors=False)
    assert row["waited_step_ms"] > 0 and row["async_step_ms"] > 0
    assert row["async_speedup"] == pytest.approx(row["waited_step_ms"] / row["async_step_ms"])
    assert_all_free(engine)
    assert not engine.has_unfinished()
