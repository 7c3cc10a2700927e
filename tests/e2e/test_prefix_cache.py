"""Prefix caching through the disaggregated stack: two prefill workers, one decode worker and the
router (cache_aware, its default) as processes, real Redis, NIXL, gRPC and HTTP, the openai
client. Prompts resumed from a prefill worker's cache pull and decode like any other: answers
equal an engine without the cache, `cached_tokens` meets the reuse targets, repeated prefixes go
to the worker holding them, and a hot prefix under load spreads over both."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from loadtest import bench_serving
from tests.serving_stack import Proc, Stack, StackSpec, openai_client, wait_all_kv_free, wait_for

pytestmark = pytest.mark.e2e  # the router and three workers as processes

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way - in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only. There "
    "were a king with a large jaw and a queen with a plain face, on the throne of England; "
)
MAX_TOKENS = 6
OK = {"role": "prefill", "outcome": "ok"}
# (conftest's `stack`) two prefill workers, one decode worker; stack.workers in that order
STACK = StackSpec(prefill=2, router_flags=("--balance-abs-threshold", "1"))


@pytest.fixture(scope="module")
def uncached(tiny):
    """The same model, no prefix cache: what every answer must be."""
    return LLM(tiny, enable_prefix_caching=False, max_num_seqs=8, kv_cache_memory_bytes=64 << 20)


def _ids(stack: Stack, prompt: str) -> list[int]:
    r = httpx.post(stack.url + "/tokenize", json={"prompt": prompt}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def _complete(stack: Stack, model, prompt: str, stream: bool = False) -> tuple[str, int]:
    client = openai_client(stack.url)
    if not stream:
        r = client.completions.create(
            model=model.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens
    chunks = list(
        client.completions.create(
            model=model.name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.prompt_tokens_details.cached_tokens


def _want(uncached: LLM, ids: list[int]) -> str:
    return uncached.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].text


def _served(workers: list[Proc]) -> list[float]:
    return [w.counter("dsaserve_worker_requests_total", **OK) for w in workers[:2]]


def test_cached_tokens_meet_the_reuse_targets(stack, tiny, uncached) -> None:
    first = TEXT * 2  # ~1300 tokens
    n = len(_ids(stack, first))
    for prompt, stream, cached in (
        (first, False, lambda c: c == 0),
        (first + "the next turn", False, lambda c: c == n),  # extends it: all of it
        (first, True, lambda c: c == n - 1),  # sent again: one token short
        (first[:900] + "elsewhere", True, lambda c: c >= 901 - 512),  # shares 901 with BOS
    ):
        text, got = _complete(stack, tiny, prompt, stream)
        assert cached(got), (len(prompt), got)
        assert text == _want(uncached, _ids(stack, prompt))
    messages = [
        {"role": "system", "content": TEXT.swapcase()},  # a prefix none sent before
        {"role": "user", "content": "Who was on the throne?"},
    ]
    client = openai_client(stack.url)
    answers = []
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=tiny.name,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            answers.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(
                model=tiny.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            answers.append(r.choices[0].message.content)
            usage = r.usage
        assert usage.prompt_tokens_details.cached_tokens == (
            usage.prompt_tokens - 1 if stream else 0
        )
    assert answers[0] == answers[1]
    wait_all_kv_free(*stack.workers)
    hits = sum(
        w.counter("dsaserve_prefix_cache_hits_total", role="prefill") for w in stack.workers[:2]
    )
    assert hits > 0


def test_repeated_prefixes_go_to_the_worker_that_holds_them(stack, tiny) -> None:
    before = _served(stack.workers)
    prefix = TEXT[::-1] * 2
    n = len(_ids(stack, prefix))
    for i in range(4):
        _, cached = _complete(stack, tiny, prefix + f" question {i}")
        # the first one's end is a checkpoint; the others differ from it in its last token
        assert cached == (0 if i == 0 else n + len(" question "))
    after = _served(stack.workers)
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 4]
    wait_all_kv_free(*stack.workers)


def test_a_hot_prefix_under_load_spreads_over_both_workers(stack, tiny) -> None:
    before = _served(stack.workers)
    hot = TEXT.upper() * 2
    _complete(stack, tiny, hot)  # one worker holds it now

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: _complete(stack, tiny, hot + f" #{i}"), range(12)))
    after = _served(stack.workers)
    assert all(a - b > 0 for a, b in zip(after, before, strict=True)), (before, after)
    assert sum(cached > 0 for _, cached in results) >= 6
    wait_for(lambda: all(w.all_kv_free() for w in stack.workers), 20, "every worker to idle")


@pytest.mark.parametrize("dataset", ["multi-turn", "generated-shared-prefix"])
def test_bench_serving_reports_the_hit_rate_of_its_cache_workloads(stack, dataset) -> None:
    result = bench_serving.run_benchmark(
        {
            "base_url": stack.url,
            "dataset": dataset,
            "num_prompts": 3,
            "multi_turn_turns": 3,
            "input_len": 40,
            "output_len": 8,
            "gsp_num_groups": 2,
            "gsp_prompts_per_group": 6,
            "gsp_system_prompt_len": 300,
            "gsp_question_len": 20,
            "gsp_output_len": 8,
            "max_concurrency": 1,  # (two requests in flight may spread over both workers)
        }
    )
    s = result["summary"]
    assert s["failed"] == 0 and s["completed"] == (9 if dataset == "multi-turn" else 12)
    # later turns resume the earlier ones (about half of all prompt tokens when every turn
    # finds its worker; a turn the router spreads to the other worker under load finds
    # nothing); a group's questions after its second resume where the first two parted
    assert s["cache_hit_rate"] > 0.3, s["cache_hit_rate"]
