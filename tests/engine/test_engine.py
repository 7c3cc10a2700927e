"""Engine behaviour on the tiny model: batching, chunking, aborts, full pools, sampling, stops."""

from __future__ import annotations

import logging

import pytest

from dsaserve.engine import models
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.kv.layout import (
    KVBudgetError,
    KVCacheConfig,
    checkpoint_bytes,
    default_checkpoint_rows,
    scratch_bytes,
    sequence_bytes,
)
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import PROMPTS, assert_all_free, byte_ids, drain

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy continuations of PROMPTS from a roomy engine that computes each prompt in one step."""
    return [r.token_ids for r in LLM(tiny, max_num_batched_tokens=512).generate(PROMPTS, GREEDY)]


def test_chunked_prefill_equals_unchunked(tiny, reference):
    chunked = LLM(tiny, max_num_batched_tokens=7).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in chunked] == reference


def test_request_admitted_while_others_decode_does_not_change_them(tiny, reference):
    engine = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=16))
    ids = [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    engine.add_request("a", ids[0], GREEDY)
    for _ in range(6):
        engine.step()
    engine.add_request("c", ids[2], GREEDY)  # a long prompt, chunked while "a" decodes
    outputs = drain(engine)
    tokens = {k: [t for o in v for t in o.new_token_ids] for k, v in outputs.items()}
    assert tokens["c"] == reference[2]
    assert_all_free(engine)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode", "finished"])
def test_abort_anywhere_frees_everything(tiny, when):
    engine = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=8, max_num_seqs=2))
    prompt = list(range(40))
    for rid in ("x", "y", "z"):  # z waits: only two slab rows
        engine.add_request(rid, prompt, SamplingParams(max_tokens=30, temperature=0))
    target = {"waiting": "z", "mid_prefill": "x", "mid_decode": "x", "finished": "x"}[when]
    steps = {"waiting": 1, "mid_prefill": 2, "mid_decode": 14, "finished": 0}[when]
    for _ in range(steps):
        engine.step()
    req = engine.scheduler.requests[target]
    assert {
        "waiting": req.num_computed == 0,
        "mid_prefill": 0 < req.num_computed < 40,
        "mid_decode": len(req.output_token_ids) > 1,
        "finished": True,
    }[when]
    if when == "finished":
        drain(engine)
        assert engine.abort(target) is False
    else:
        assert engine.abort(target) is True
        assert engine.abort(target) is False
    for rid in ("x", "y", "z"):
        engine.abort(rid)
    assert_all_free(engine)


def test_full_pool_queues_requests_and_all_finish(tiny, reference):
    """A pool holding ~2 requests runs 5: they queue (and get preempted), yet answer as in a
    roomy pool."""
    engine = LLMEngine(
        tiny,
        EngineConfig(
            kv_cache_memory_bytes=800_000, page_size=4, max_num_seqs=8, max_num_batched_tokens=32
        ),
    )
    ids = [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    longer = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    need = sum(engine.pool.pages_for("csa", len(p) + longer.max_tokens) for p in ids)
    assert need > engine.pool.groups["csa"].num_pages - 1, (
        "the pool must be too small for the batch"
    )
    for i, p in enumerate(ids):
        engine.add_request(str(i), p, longer)
    outputs = drain(engine)
    tokens = [[t for o in outputs[str(i)] for t in o.new_token_ids] for i in range(len(ids))]
    assert [
        t[: GREEDY.max_tokens] for t in tokens
    ] == reference  # greedy: a longer run extends the shorter
    assert all(len(t) == longer.max_tokens for t in tokens)
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_request_that_can_never_fit_is_rejected(tiny):
    engine = LLMEngine(
        tiny,
        EngineConfig(
            kv_cache_memory_bytes=800_000, page_size=4, max_num_seqs=8, max_num_batched_tokens=32
        ),
    )
    with pytest.raises(RequestError, match=r"KV pool, which has \d+; lower max_tokens"):
        engine.add_request("big", list(range(200)) * 10, SamplingParams(max_tokens=100))
    assert_all_free(engine)


def test_max_num_seqs_is_lowered_to_what_the_budget_holds(tiny, caplog):
    """The default max_num_seqs gives sequences' fixed state at most half of what the scratch
    rows and checkpoints leave; an asked number is kept while the budget holds it beside some
    context, else lowered; a budget that holds no sequence is refused, naming the flag."""
    small = dict(kv_cache_memory_bytes=4 << 20, page_size=4, max_num_batched_tokens=32)
    kv = KVCacheConfig(4 << 20, 4, 256, 32)
    cfg = models.family(tiny).ModelConfig.from_dir(tiny)
    ckpt = default_checkpoint_rows(cfg, kv, 4) * checkpoint_bytes(cfg, 4, 4)
    half = (kv.memory_bytes - scratch_bytes(cfg, kv, 4) - ckpt) // 2
    with caplog.at_level(logging.INFO, logger="dsaserve.engine.rank"):
        engine = LLMEngine(tiny, EngineConfig(**small))
    seqs = engine.config.max_num_seqs
    assert seqs == half // sequence_bytes(cfg, kv, 4) < 256
    assert engine.pool.slab.num_free == seqs  # (the dummy row taken)
    assert f"max_num_seqs lowered from 256 to {seqs}" in caplog.text
    engine.add_request("a", byte_ids(40, 1), GREEDY)
    drain(engine)
    assert_all_free(engine)
    asked = LLMEngine(tiny, EngineConfig(**small, max_num_seqs=seqs + 1))
    assert asked.config.max_num_seqs == seqs + 1
    too_many = LLMEngine(tiny, EngineConfig(**small, max_num_seqs=10 * seqs))
    assert seqs + 1 < too_many.config.max_num_seqs < 10 * seqs
    with pytest.raises(KVBudgetError, match="raise --kv-cache-memory-bytes"):
        LLMEngine(tiny, EngineConfig(**dict(small, kv_cache_memory_bytes=200_000)))


def test_context_length_caps_prompt_plus_output(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_model_len=64))
    with pytest.raises(
        RequestError, match="context length is 64 tokens. However, 70 tokens were requested"
    ):
        engine.add_request("r", list(range(50)), SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="the prompt has 64 tokens"):
        engine.add_request("r", list(range(64)), SamplingParams(max_tokens=None))
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 262\)"):
        engine.add_request("r", [5, 262], SamplingParams())
    engine.add_request(
        "r", list(range(50)), SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    )
    [done] = [o for o in drain(engine)["r"] if o.finished]
    assert done.finish_reason == "length" and done.completion_tokens == 14


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    llm = LLM(tiny)
    seeded = SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate("seeded prompt", seeded)[0].token_ids
    batched = llm.generate(
        ["other", "seeded prompt", "more"],
        [SamplingParams(max_tokens=5, temperature=1.0), seeded, SamplingParams(max_tokens=9)],
    )[1].token_ids
    assert alone == batched
    other_seed = llm.generate("seeded prompt", SamplingParams(**{**seeded.__dict__, "seed": 99}))[
        0
    ].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(tiny, reference):
    llm = LLM(tiny)
    [res] = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, ignore_eos=True)
    )
    assert res.token_ids == reference[0]


def _streamed(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[str, list, str]:
    engine.add_request("s", prompt, params)
    outs = drain(engine)["s"]
    return (
        "".join(o.text for o in outs),
        [t for o in outs for t in o.new_token_ids],
        outs[-1].finish_reason,
    )


def test_stop_strings_end_the_text_before_them(tiny):
    engine = LLMEngine(tiny)
    prompt = engine.tokenizer.encode("Hello", add_special_tokens=True)
    full, _, _ = _streamed(
        engine, prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    )
    clean = [i for i in range(8, len(full) - 3) if "\ufffd" not in full[i : i + 3]]
    assert clean, "the tiny model's greedy text has no clean 3-character span"
    stop = full[clean[0] : clean[0] + 3]
    text, _, reason = _streamed(
        engine,
        prompt,
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["\x00never", stop]),
    )
    assert reason == "stop"
    assert text == full[: full.index(stop)]
    assert_all_free(engine)


def test_stop_token_ids_end_generation_and_hide_the_token(tiny, reference):
    engine = LLMEngine(tiny)
    prompt = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    stop_token = reference[0][5]
    first = reference[0].index(stop_token)
    text, tokens, reason = _streamed(
        engine, prompt, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])
    )
    assert reason == "stop" and tokens == reference[0][: first + 1]
    assert text == engine.tokenizer.decode(reference[0][:first])


def test_prefill_only_requests_hold_their_kv_until_released_or_aborted(tiny):
    """The prefill half of disaggregation: one token, then the KV stays until release/abort."""
    engine = LLMEngine(tiny)
    for rid in ("released", "aborted"):
        engine.add_request(
            rid, list(range(50)), SamplingParams(max_tokens=8, temperature=0), prefill_only=True
        )
    outputs = drain(engine)
    assert all(
        len(o) == 1 and o[0].finished and o[0].finish_reason is None for o in outputs.values()
    )
    held = engine.handoff.held_pages("released")
    assert held.num_tokens == 50 and held.pages["slab"] and engine.load().held == 2
    assert engine.load().free_pages < engine.load().total_pages
    assert engine.handoff.release("released") and engine.abort("aborted")
    assert engine.load().held == 0 and not engine.handoff.release("released")
    assert_all_free(engine)
