"""The chat API on real workers with a V4-format checkpoint: a tiny model whose tokenizer is the
release's in miniature (no chat template, every V4 marker), so chats go through the release's
encoder. Logprobs are checked against the engine's own offline numbers, chat replies against
`dsaserve generate --chat`, and every request must leave the workers' KV free. The checkpoint
is `dsaserve make-tiny-model DIR --format release`'s.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.text.chat import tokens as v4
from tests.serving_stack import FORECAST, StackSpec, wait_all_kv_free

pytestmark = pytest.mark.e2e  # the router and both workers as processes

STACK = StackSpec(model="release", db=4)  # (conftest's `stack`) in a registry of its own

MESSAGES = [{"role": "user", "content": "Name three rivers."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def llm(release):
    return LLM(release)


def _tokenize(stack, body: dict) -> list[int]:
    response = httpx.post(stack.url + "/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_logprobs_equal_the_engines_own(stack, client, release, llm):
    """Sampled at temperature 0.8 with a seed: the same tokens as the offline engine, and each
    token's raw logprob and top alternatives as it computes them."""
    prompt = _tokenize(stack, {"messages": MESSAGES})
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=3, ignore_eos=True)
    offline = llm.generate(prompt, params)[0]
    res = client.chat.completions.create(
        model=release.name,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0.8,
        seed=7,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = res.choices[0].logprobs.content
    assert len(content) == len(offline.token_ids) == res.usage.completion_tokens
    for entry, token, lp in zip(content, offline.token_ids, offline.logprobs, strict=True):
        assert entry.bytes == list(llm.tokenizer.token_bytes(token))
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [t.bytes for t in entry.top_logprobs] == [
            list(llm.tokenizer.token_bytes(i)) for i in lp.top_ids
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp.top_logprobs, abs=1e-4)
    wait_all_kv_free(stack.prefill, stack.decode)


def test_completion_logprobs_equal_the_engines_own(stack, client, release, llm):
    prompt = "Once upon a time"
    offline = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, logprobs=2))[0]
    res = client.completions.create(
        model=release.name, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, stream=True
    )
    chunks = [c.choices[0] for c in res]
    text = "".join(c.text for c in chunks)
    logprobs = [c.logprobs for c in chunks if c.logprobs is not None]
    token_logprobs = [v for lp in logprobs for v in lp.token_logprobs]
    assert text == offline.text
    assert token_logprobs == pytest.approx([lp.logprob for lp in offline.logprobs], abs=1e-4)
    tokens = [t for lp in logprobs for t in lp.tokens]
    offsets = [o for lp in logprobs for o in lp.text_offset]
    # Each whole token's text sits at its offset in the completion (special tokens such as the
    # end of the sequence have a logprob but no text).
    for token, offset in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token and token not in (v4.BOS, v4.EOS):
            assert text[offset : offset + len(token)] == token
    wait_all_kv_free(stack.prefill, stack.decode)


def _offline_chat(release, messages, thinking: bool) -> dict:
    """`dsaserve generate --chat` in its own process, greedy: the parsed reply."""
    argv = [sys.executable, "-m", "dsaserve.services.cli", "generate", "--model", str(release)]
    argv += ["--chat", json.dumps(messages), "--max-tokens", "24", "--temperature", "0"]
    argv += ["--json", "--ignore-eos"] + (["--thinking"] if thinking else [])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_thinking_chat_equals_offline_generation(stack, client, release):
    """The router and `dsaserve generate --chat --thinking` pick the same encoder and read the
    reply the same way: reasoning, content and calls agree, streamed or not."""
    offline = _offline_chat(release, MESSAGES, thinking=True)["message"]
    assert offline["reasoning_content"]  # the reply opened in reasoning
    extra = {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}
    request = dict(model=release.name, messages=MESSAGES, max_tokens=24, temperature=0)
    res = client.chat.completions.create(**request, extra_body=extra)
    message = res.choices[0].message
    assert (message.model_extra.get("reasoning_content") or "") == offline["reasoning_content"]
    assert (message.content or "") == offline["content"]
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert calls == [(c["name"], c["arguments"]) for c in offline["tool_calls"]]
    chunks = list(client.chat.completions.create(**request, stream=True, extra_body=extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert streamed == offline["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == offline["content"]
    wait_all_kv_free(stack.prefill, stack.decode)


def test_n_choices_on_real_workers(stack, client, release):
    request = dict(model=release.name, messages=MESSAGES, max_tokens=8, temperature=1.0)
    extra = {"ignore_eos": True}
    res = client.chat.completions.create(**request, seed=11, n=3, extra_body=extra)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert res.usage.completion_tokens == 3 * 8
    # Seeds 11, 12 and 13: three different samples (a tie on 8 random tokens is not credible).
    assert len({c.message.content for c in res.choices}) == 3
    again = client.chat.completions.create(**request, seed=12, extra_body=extra)
    assert again.choices[0].message.content == res.choices[1].message.content
    wait_all_kv_free(stack.prefill, stack.decode)


# ---------------------------------------------------------------- structured outputs
# Random weights: only the constraint makes a reply valid. Greedy, so every reply is the same
# on every run; the requests of a test run at once (one decode batch).


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)
    sure: bool


CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
STRUCTURED = dict(messages=MESSAGES, temperature=0, max_tokens=64)
THINKING_ON = {"chat_template_kwargs": {"thinking": True}}


async def _parse(client, release, stream: bool, thinking: bool) -> tuple[str, Any]:
    """`.parse()` (or `.stream()`) with the pydantic model: (finish reason, the completion).
    Thinking: its reasoning bounded by vLLM's thinking_token_budget (random weights would
    otherwise never write </think>)."""
    extra = THINKING_ON | {"thinking_token_budget": 6} if thinking else {}
    request = dict(model=release.name, response_format=Verdict, extra_body=extra, **STRUCTURED)
    try:
        if stream:
            async with client.chat.completions.stream(**request) as events:
                completion = await events.get_final_completion()
        else:
            completion = await client.chat.completions.parse(**request)
    except openai.LengthFinishReasonError as e:  # the client's own: cut by max_tokens
        return "length", e.completion
    return completion.choices[0].finish_reason, completion


def test_parse_with_a_pydantic_schema_and_json_object(stack, release):
    """Every reply parses into the model, after a bounded reasoning with thinking on.
    json_object, thinking on and unbounded: a JSON object, or cut by max_tokens in the
    reasoning or the JSON, never JSON in the reasoning or other text in the content."""

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-") as client:
            parses = [
                _parse(client, release, stream, thinking)
                for thinking in (False, True)
                for stream in (False, True)
            ]
            json_object = client.chat.completions.create(
                model=release.name,
                response_format={"type": "json_object"},
                extra_body=THINKING_ON,
                **STRUCTURED,
            )
            return await asyncio.gather(*parses, json_object)

    *parsed, json_object = asyncio.run(run())
    for (reason, completion), thinking in zip(parsed, (False, False, True, True), strict=True):
        message = completion.choices[0].message
        assert reason == "stop" and isinstance(message.parsed, Verdict)
        reasoning = message.model_extra.get("reasoning_content")
        assert bool(reasoning) is thinking
    for whole, streamed in (parsed[:2], parsed[2:]):
        assert whole[1].choices[0].message.parsed == streamed[1].choices[0].message.parsed
    message = json_object.choices[0].message
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(message.content), dict)
    else:  # cut inside the reasoning, or inside the JSON that follows it
        assert message.model_extra["reasoning_content"]
        assert (message.content or "{").startswith("{")
    wait_all_kv_free(stack.prefill, stack.decode)


def test_tool_choice_required_and_named(stack, release):
    """ "required" and a named function (one call each): every reply is a call whose arguments
    follow the tool's schema, streamed as the whole answer has it."""
    named = {"type": "function", "function": {"name": "forecast"}}

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="-") as client:
            requests = [
                client.chat.completions.create(
                    model=release.name,
                    messages=MESSAGES,
                    tools=[FORECAST, CLOCK],
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    stream=stream,
                    temperature=0,
                    max_tokens=128,  # (the byte tokenizer spells a call in ~120 tokens)
                )
                for choice in ("required", named)
                for stream in (False, True)
            ]
            replies = await asyncio.gather(*requests)
            return [r if not i % 2 else [c async for c in r] for i, r in enumerate(replies)]

    replies = asyncio.run(run())
    for whole, chunks in (replies[:2], replies[2:]):
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and not message.content
        (call,) = message.tool_calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "forecast":
            assert set(arguments) == {"days"} and 1 <= arguments["days"] <= 7
        else:
            assert call.function.name == "clock" and arguments == {}
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == call.function.name
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert replies[2].choices[0].message.tool_calls[0].function.name == "forecast"
    wait_all_kv_free(stack.prefill, stack.decode)
