"""The chat API's V4 features through the router, against scripted gRPC workers: reasoning and
DSML tool calls parsed out of scripted model output (streamed and whole, with the official
OpenAI client), forced tool choice, logprobs in OpenAI's shapes, n > 1, and /tokenize equal to
what prefill receives.

The V4 router model (conftest `v4_router_model_dir`) has no chat template, so its chats go
through the release's encoder; workers send text and token ids as real ones would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio

from dsaserve.engine.text.chat import encode_messages
from dsaserve.engine.text.chat.tokens import DSML as D
from dsaserve.engine.text.tokenizer import Tokenizer
from dsaserve.services.router.api.logprobs import CompletionLogprobs, TokenTexts
from dsaserve.services.rpc import pb
from tests.scripted_worker import MODEL, WAIT_S, Serve, chunk_ids, scripted_logprob, sse_events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "weather in São Paulo?"}]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
THINKING = {"chat_template_kwargs": {"thinking": True}}

# A thinking-mode reply with everything: reasoning, content, then two calls, the first with a
# string (quotes, non-ASCII) and a JSON value, the second without parameters.
REASONING = "Two lookups; 2 < 3."
CONTENT = "On it."
INVOKE_WEATHER = (
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">São "P"</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">[1, 2]</{D}parameter>\n'
    f"</{D}invoke>"
)
INVOKE_NOW = f'<{D}invoke name="now">\n</{D}invoke>'
BLOCK = f"\n\n<{D}tool_calls>\n{INVOKE_WEATHER}\n{INVOKE_NOW}\n</{D}tool_calls>"
REPLY = f"{REASONING}</think>{CONTENT}{BLOCK}"
CALLS = [("get_weather", '{"city": "São \\"P\\"", "days": [1, 2]}'), ("now", "{}")]


class V4:
    """Scripted prefill and decode workers, and routers with the V4 encoder in front of them."""

    def __init__(self, prefill: Any, decode: Any, make_router: Any, model_dir: Path) -> None:
        self.prefill, self.decode = prefill, decode
        self._make_router, self._model_dir = make_router, model_dir

    async def router(self, **settings: Any) -> Any:
        return await self._make_router(model_dir=self._model_dir, **settings)

    def script(self, pieces: list[str], finish: int = pb.FINISH_REASON_STOP) -> None:
        """The model writes `pieces`: the first from prefill, each other one a decode chunk."""
        self.prefill.first_text = pieces[0]
        self.decode.chunks, self.decode.decode_finish = tuple(pieces[1:]), finish

    def last_prompt(self) -> list[int]:
        return list(self.prefill.prefill_requests[-1].prompt_token_ids)


@pytest_asyncio.fixture
async def v4(serve: Serve, make_router: Any, v4_router_model_dir: Path) -> V4:
    return V4(
        await serve("prefill", "p1"), await serve("decode", "d1"), make_router, v4_router_model_dir
    )


def assembled(chunks: list[dict]) -> dict:
    """One choice's streamed deltas added up the way clients do; checks each delta's shape."""
    out: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": {}, "finish": None}
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        for key in ("reasoning_content", "content"):
            text = delta.get(key)
            if text:
                # No marker's characters ever reach the text channels.
                assert "｜" not in text and "</think>" not in text, delta
                out[key] += text
        for call in delta.get("tool_calls", []):
            calls = out["calls"]
            if call["index"] not in calls:  # the first fragment names the call
                assert call["type"] == "function" and call["id"].startswith("call_")
                calls[call["index"]] = [call["id"], call["function"]["name"], ""]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]][2] += call["function"]["arguments"]
        out["finish"] = choice["finish_reason"] or out["finish"]
    return out


async def stream(router: Any, body: dict, http: httpx.AsyncClient | None = None) -> list[dict]:
    """A streamed chat's chunks (the final [DONE] checked and dropped)."""
    async with contextlib.AsyncExitStack() as stack:
        if http is None:
            http = await stack.enter_async_context(
                httpx.AsyncClient(base_url=router.url, timeout=WAIT_S)
            )
        r = await stack.enter_async_context(
            http.stream("POST", "/v1/chat/completions", json=body | {"stream": True})
        )
        assert r.status_code == 200, await r.aread()
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def calls_of(got: dict) -> list[tuple[str, str]]:
    return [(name, args) for _, name, args in got["calls"].values()]


async def post(router: Any, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------- reasoning and tool calls


@pytest.mark.asyncio
async def test_openai_client_gets_reasoning_and_streamed_tool_calls(v4: V4) -> None:
    router = await v4.router()
    v4.script([REPLY[:7], REPLY[7:40], REPLY[40:90], REPLY[90:]])
    client = router.openai()
    request = {"model": MODEL, "messages": CHAT["messages"], "tools": [WEATHER, NOW]}

    response = await client.chat.completions.create(**request, stream=True, extra_body=THINKING)
    deltas = [chunk.choices[0] async for chunk in response]
    reasoning = "".join(d.delta.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.delta.content or "" for d in deltas)
    assert (reasoning, content) == (REASONING, CONTENT)
    fragments = [call for d in deltas for call in d.delta.tool_calls or []]
    starts = [(f.index, f.type, f.function.name) for f in fragments if f.id is not None]
    assert starts == [(0, "function", "get_weather"), (1, "function", "now")]
    arguments = [
        "".join(f.function.arguments or "" for f in fragments if f.index == i) for i in (0, 1)
    ]
    assert arguments == [args for _, args in CALLS]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]

    whole = await client.chat.completions.create(**request, extra_body=THINKING)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content == CONTENT
    calls = [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [("function", name, args) for name, args in CALLS]
    assert len({c.id for c in message.tool_calls}) == 2
    assert whole.choices[0].finish_reason == "tool_calls"
    # The release's thinking-mode prompt: the user turn, then <｜Assistant｜><think>.
    assert v4.last_prompt()[-3:] == [ord("?"), 259, 260]


def splits() -> list[list[str]]:
    return [[REPLY[:i], REPLY[i:]] for i in range(len(REPLY) + 1)] + [list(REPLY)]


@pytest.mark.asyncio
async def test_every_split_of_the_markup_streams_the_same_reply(v4: V4) -> None:
    """Every cut of the reply into a prefill token and a decode chunk, and one character per
    chunk: the stream always adds up to the same reasoning, content and calls, and no markup
    leaks; the whole (non-streamed) answer says the same."""
    router = await v4.router()
    body = CHAT | THINKING | {"tools": [WEATHER, NOW]}
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        for n, pieces in enumerate(splits()):
            v4.script(pieces)
            got = assembled(await stream(router, body, http))
            assert (got["reasoning_content"], got["content"], calls_of(got), got["finish"]) == (
                REASONING,
                CONTENT,
                CALLS,
                "tool_calls",
            ), pieces
            if n % 16 == 0:  # the same parse path: a sample suffices
                response = await http.post("/v1/chat/completions", json=body)
                whole = response.json()["choices"][0]["message"]
                calls = [
                    (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
                ]
                assert (whole["reasoning_content"], whole["content"], calls) == (
                    REASONING,
                    CONTENT,
                    CALLS,
                ), pieces


@pytest.mark.asyncio
async def test_replies_that_never_close_their_reasoning_or_tool_block(v4: V4) -> None:
    router = await v4.router()
    # Cut by max_tokens while reasoning: all of it is reasoning, and the reason says so.
    v4.script(["Let me think", " about </th"], pb.FINISH_REASON_LENGTH)
    got = assembled(await stream(router, CHAT | THINKING))
    assert (got["reasoning_content"], got["content"], got["finish"]) == (
        "Let me think about ",
        "",
        "length",
    )
    # Straight from reasoning into a call (no </think>), then the model stopped inside the
    # block's second call: the first call is kept, the reasoning ended where the block began.
    cut = f"{REASONING}\n\n<{D}tool_calls>\n{INVOKE_WEATHER}\n<{D}invoke na"
    v4.script([cut[:30], cut[30:]])
    got = assembled(await stream(router, CHAT | THINKING | {"tools": [WEATHER]}))
    assert (got["reasoning_content"], got["content"]) == (REASONING, "")
    assert (calls_of(got), got["finish"]) == (CALLS[:1], "tool_calls")
    # Cut by max_tokens inside a call's arguments: what was written stays, "length" says why.
    cut = f"{CONTENT}\n\n<{D}tool_calls>\n{INVOKE_WEATHER[: INVOKE_WEATHER.index('ão')]}"
    v4.script([cut[:3], cut[3:]], pb.FINISH_REASON_LENGTH)
    got = assembled(await stream(router, CHAT | {"tools": [WEATHER]}))
    assert got["content"] == CONTENT and got["finish"] == "length"
    assert calls_of(got) == [("get_weather", '{"city": "S')]
    # Chat mode: the reply is content from the start; stray think tags are dropped.
    v4.script(["Sunny", "</think> today."])
    got = assembled(await stream(router, CHAT))
    assert (got["reasoning_content"], got["content"], got["finish"]) == ("", "Sunny today.", "stop")
    assert v4.last_prompt()[-2:] == [259, 261]  # <｜Assistant｜></think>


@pytest.mark.asyncio
@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
async def test_forced_tool_choice_constrains_the_reply_after_its_reasoning(
    v4: V4, named: bool
) -> None:
    # Thinking is on by default here, and stays on: the constraint starts after the reasoning.
    router = await v4.router(default_thinking=True)
    call = f'{BLOCK[: BLOCK.index(INVOKE_WEATHER)]}<{D}invoke name="get_weather">\n'
    call += f'<{D}parameter name="city" string="true">Lima</{D}parameter>\n</{D}invoke>\n'
    call += f"</{D}tool_calls>"
    v4.script(["Look it up.", "</think>" + call[:9], call[9:]])
    if named:
        tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    else:
        tool_choice = "required"
    chunks = await stream(router, CHAT | {"tools": [WEATHER, NOW], "tool_choice": tool_choice})
    got = assembled(chunks)
    assert calls_of(got) == [("get_weather", '{"city": "Lima"}')]
    assert (got["reasoning_content"], got["content"], got["finish"]) == (
        "Look it up.",
        "",
        "tool_calls",
    )
    prompt = (await post(router, "/detokenize", {"tokens": v4.last_prompt()}))["prompt"]
    assert prompt.endswith("<｜Assistant｜><think>")
    # Only the named tool is shown to the model, and only it can be called.
    assert ('{"name": "now"}' in prompt) is not named
    grammar = v4.prefill.prefill_requests[-1].sampling.grammar
    assert grammar == v4.decode.decode_requests[-1].sampling.grammar
    assert 'name=\\"get_weather\\"' in grammar and ('name=\\"now\\"' in grammar) is not named


@pytest.mark.asyncio
async def test_response_format_sends_its_grammar_to_both_workers(v4: V4) -> None:
    router = await v4.router()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    v4.script(['Easy.</think>{"a"', ": 1}"])
    body = CHAT | THINKING | {"response_format": response_format}
    answer = await post(router, "/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == '{"a": 1}'
    grammar = v4.prefill.prefill_requests[-1].sampling.grammar
    assert grammar == v4.decode.decode_requests[-1].sampling.grammar
    assert grammar.startswith("start: reasoning <[261]> body") and '"required": ["a"]' in grammar
    completion = {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}
    await post(router, "/v1/completions", completion)
    grammar = v4.prefill.prefill_requests[-1].sampling.grammar
    assert grammar.startswith("start: body") and '%json {"type": "object"' in grammar
    await post(router, "/v1/chat/completions", CHAT | {"tools": [WEATHER]})  # nothing to constrain
    assert not v4.prefill.prefill_requests[-1].sampling.HasField("grammar")


@pytest.mark.asyncio
async def test_a_grammar_over_its_compile_budget_is_a_400_and_its_process_is_replaced(
    v4: V4,
) -> None:
    """Hundreds of patternProperties take llguidance tens of seconds to compile: the grammar
    process is killed at the budget and the request refused; the next grammar is compiled by a
    new process, and the same hostile schema again is refused from the cache at once."""
    router = await v4.router(grammar_compile_timeout_s=0.3)
    patterns = {f"^p{i}[a-z]+$": {"type": "integer"} for i in range(400)}
    hostile = {"type": "object", "patternProperties": patterns}
    spec = {"type": "json_schema", "json_schema": {"name": "h", "schema": hostile}}
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        for _ in range(2):
            r = await http.post("/v1/chat/completions", json=CHAT | {"response_format": spec})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "0.3 s budget (--grammar-compile-timeout)" in error["message"]
            assert error["param"] == "response_format"
    assert v4.prefill.prefill_requests == []  # (no worker saw them)
    v4.script(['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fine = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    answer = await post(router, "/v1/chat/completions", CHAT | {"response_format": fine})
    assert answer["choices"][0]["message"]["content"] == '{"a": 1}'


@pytest.mark.asyncio
async def test_a_call_cut_by_eos_is_no_tool_call(v4: V4) -> None:
    router = await v4.router()
    cut = f'{BLOCK[: BLOCK.index(INVOKE_WEATHER)]}<{D}invoke name="get_weather">\n'
    v4.script([CONTENT, cut])
    got = assembled(await stream(router, CHAT | {"tools": [WEATHER]}))
    assert got["finish"] == "stop"
    whole = await post(router, "/v1/chat/completions", CHAT | {"tools": [WEATHER]})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


@pytest.mark.asyncio
async def test_parallel_tool_calls_false_keeps_the_first_call(v4: V4) -> None:
    router = await v4.router()
    v4.script([REPLY[:50], REPLY[50:]])
    body = CHAT | THINKING | {"tools": [WEATHER, NOW], "parallel_tool_calls": False}
    got = assembled(await stream(router, body))
    assert (calls_of(got), got["finish"]) == (CALLS[:1], "tool_calls")
    whole = (await post(router, "/v1/chat/completions", body))["choices"][0]["message"]
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Lima and the time?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Two tools.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
]


@pytest.mark.asyncio
async def test_tool_history_is_encoded_as_the_release_does(v4: V4) -> None:
    router = await v4.router()
    body = {"model": MODEL, "messages": HISTORY, "tools": [WEATHER, NOW]} | THINKING
    await post(router, "/v1/chat/completions", body)
    prompt = (await post(router, "/detokenize", {"tokens": v4.last_prompt()}))["prompt"]
    assert prompt == encode_messages(HISTORY, thinking=True, tools=[WEATHER, NOW])
    # Results in call order inside one user turn, the assistant's reasoning kept (tools).
    assert "Two tools.</think>Checking." in prompt
    assert prompt.index("<tool_result>sunny") < prompt.index("<tool_result>noon")


TOKENIZE_BODIES = [
    {},
    THINKING | {"reasoning_effort": "max"},
    {"reasoning_effort": "medium"},
    {"tools": [WEATHER, NOW]},
    {"tools": [WEATHER, NOW], "tool_choice": "none"},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {
        "messages": HISTORY,
        "tools": [WEATHER, NOW],
        "chat_template_kwargs": {"drop_thinking": False},
    },
]


@pytest.mark.asyncio
@pytest.mark.parametrize("v4_format", [True, False], ids=["v4-encoder", "jinja"])
async def test_tokenize_equals_what_prefill_received(
    v4: V4, make_router: Any, v4_format: bool
) -> None:
    router = await v4.router(default_thinking=True) if v4_format else await make_router()
    bodies = TOKENIZE_BODIES if v4_format else [{}, THINKING, {"reasoning_effort": "none"}]
    for extra in bodies:
        body = CHAT | extra
        tokens = (await post(router, "/tokenize", body))["tokens"]
        await post(router, "/v1/chat/completions", body)
        assert tokens == v4.last_prompt(), extra


# ---------------------------------------------------------------- logprobs


def expected_chat_entries(token_ids: list[int], k: int) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        data = bytes([token_id])  # byte-level tokenizer: id == byte value
        return {"token": data.decode(errors="replace"), "logprob": logprob, "bytes": list(data)}

    entries = []
    for t in token_ids:
        lp = scripted_logprob(t, k)
        top = [entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
        entries.append({**entry(t, lp.logprob), "top_logprobs": top})
    return entries


@pytest.mark.asyncio
async def test_chat_logprobs_in_openai_shape(serve: Serve, make_router: Any) -> None:
    # Token ids 72 ("H"), 0xC3 0xA9 ("é", split across two tokens), then "llo".
    prefill = await serve("prefill", "p1", first_text="H", first_token_id=72)
    await serve("decode", "d1", chunks=("é", "llo"))
    router = await make_router()
    body = CHAT | {"logprobs": True, "top_logprobs": 2}
    expected = expected_chat_entries([72, *chunk_ids("é"), *chunk_ids("llo")], 2)

    whole = (await post(router, "/v1/chat/completions", body))["choices"][0]
    assert whole["logprobs"] == {"content": expected, "refusal": None}
    assert whole["message"]["content"] == "Héllo"
    assert prefill.prefill_requests[-1].sampling.logprobs == 2

    chunks = await stream(router, body)
    streamed = [
        e
        for c in chunks
        if c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == expected
    # The official client reads them; logprobs: true alone lists no alternatives.
    chat = await router.openai().chat.completions.create(
        model=MODEL, messages=CHAT["messages"], logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.bytes, c.top_logprobs) for c in content[:2]] == [
        ("H", [72], []),
        ("\ufffd", [0xC3], []),
    ]
    plain = (await post(router, "/v1/chat/completions", CHAT))["choices"][0]
    assert plain["logprobs"] is None and not prefill.prefill_requests[-1].sampling.HasField(
        "logprobs"
    )


@pytest.mark.asyncio
async def test_completion_logprobs_in_the_legacy_shape(serve: Serve, make_router: Any) -> None:
    await serve("prefill", "p1", first_text="H", first_token_id=72)
    await serve("decode", "d1", chunks=("é", "llo"))
    router = await make_router()
    body = {"model": MODEL, "prompt": "hi", "logprobs": 1}
    ids = [72, 0xC3, 0xA9, *b"llo"]
    tokens = ["H", "\ufffd", "\ufffd", "l", "l", "o"]

    def top(t: int) -> dict:
        lp = scripted_logprob(t, 1)
        # The likeliest alternative and the sampled token (OpenAI's "up to logprobs + 1").
        return {
            bytes([lp.top_token_ids[0]]).decode(errors="replace"): lp.top_logprobs[0],
            bytes([t]).decode(errors="replace"): lp.logprob,
        }

    expected = {
        "text_offset": [0, 1, 1, 2, 3, 4],  # "é" begins at 1; its second byte adds no text
        "token_logprobs": [scripted_logprob(t, 1).logprob for t in ids],
        "tokens": tokens,
        "top_logprobs": [top(t) for t in ids],
    }
    whole = (await post(router, "/v1/completions", body))["choices"][0]
    assert (whole["text"], whole["logprobs"]) == ("Héllo", expected)
    async with (
        httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r,
    ):
        chunks = (await sse_events(r))[:-1]
    streamed = {
        key: [
            v
            for c in chunks
            if c["choices"][0]["logprobs"]
            for v in c["choices"][0]["logprobs"][key]
        ]
        for key in expected
    }
    assert streamed == expected


# ---------------------------------------------------------------- n > 1


@pytest.mark.asyncio
async def test_n_choices_are_generations_of_their_own(serve: Serve, make_router: Any) -> None:
    prefill = await serve("prefill", "p1")
    decode = await serve("decode", "d1")
    router = await make_router()
    body = CHAT | {"n": 3, "seed": 5, "stream_options": {"include_usage": True}}
    chunks = await stream(router, body)
    by_choice: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        by_choice[choice["index"]] = by_choice.get(choice["index"], "") + choice["delta"].get(
            "content", ""
        )
    assert by_choice == {0: "Hello world", 1: "Hello world", 2: "Hello world"}
    finishes = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    # One usage: the prompt once, every choice's completion tokens.
    prompt_tokens = len(prefill.prefill_requests[0].prompt_token_ids)
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 9,
        "total_tokens": prompt_tokens + 9,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},  # (no thinking)
    }
    sent = prefill.prefill_requests
    assert sorted(r.sampling.seed for r in sent) == [5, 6, 7]
    assert len({r.request_id for r in sent}) == 3
    assert {r.request_id for r in decode.decode_requests} == {r.request_id for r in sent}
    assert all(r.request_id.startswith(chunks[0]["id"] + "-") for r in sent)

    whole = await post(router, "/v1/chat/completions", CHAT | {"n": 2})
    assert [(c["index"], c["message"]["content"]) for c in whole["choices"]] == [
        (0, "Hello world"),
        (1, "Hello world"),
    ]
    assert whole["usage"]["completion_tokens"] == 6


@pytest.mark.asyncio
async def test_a_client_that_leaves_ends_every_choice(serve: Serve, make_router: Any) -> None:
    hold = asyncio.Event()
    prefill = await serve("prefill", "p1")
    decode = await serve("decode", "d1", hold_decode=hold)
    router = await make_router()
    try:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http,
            http.stream("POST", "/v1/chat/completions", json=CHAT | {"n": 2, "stream": True}) as r,
        ):
            seen: set[int] = set()
            lines = r.aiter_lines()
            while len(seen) < 2:  # both choices are streaming
                line = await asyncio.wait_for(anext(lines), WAIT_S)
                if "world" in line:
                    seen.add(json.loads(line.removeprefix("data: "))["choices"][0]["index"])
        # Leaving the block hung up: both prefills are aborted (their KV may be held).
        await wait_until(lambda: len(prefill.aborted) == 2)
        assert sorted(prefill.aborted) == sorted(r.request_id for r in decode.decode_requests)
    finally:
        hold.set()


@pytest.mark.asyncio
async def test_a_failed_prefill_fails_the_request_before_any_answer(
    serve: Serve, make_router: Any
) -> None:
    prefill = await serve("prefill", "p1", prefill_status=grpc.StatusCode.INVALID_ARGUMENT)
    decode = await serve("decode", "d1")
    router = await make_router()
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        response = await http.post("/v1/chat/completions", json=CHAT | {"n": 3, "stream": True})
    assert response.status_code == 400 and "scripted" in response.json()["error"]["message"]
    assert len(prefill.prefill_requests) >= 1 and decode.decode_requests == []


async def wait_until(condition: Any) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)  # polling a condition, bounded by the deadline


def test_text_offsets_where_bytes_do_not_make_whole_characters(v4_router_model_dir: Path) -> None:
    texts = TokenTexts(Tokenizer.from_pretrained(v4_router_model_dir))
    logprobs = CompletionLogprobs(texts)
    lp = pb.TokenLogprob(logprob=-1.0)
    # "é" split in two, a lone lead byte that "H" turns into U+FFFD, then "!" after it.
    ids = [0xC3, 0xA9, 0xC3, ord("H"), ord("!")]
    offsets = [*logprobs.chunk(ids[:3], [lp] * 3)["text_offset"]]
    offsets += logprobs.chunk(ids[3:], [lp] * 2)["text_offset"]
    assert texts.tokenizer.decode(ids) == "é\ufffdH!"
    assert offsets == [0, 0, 1, 2, 3]


# ---------------------------------------------------------------- release inputs, vLLM fields


@pytest.mark.asyncio
async def test_release_inputs_and_vllm_spellings_are_accepted(v4: V4) -> None:
    """`latest_reminder` messages, chat_template_kwargs' reasoning_effort, vLLM's `reasoning`
    for `reasoning_content`, and a tool loop whose client left the reasoning out: each renders
    the release's prompt, and the reply after a reminder in thinking mode opens in reasoning."""
    router = await v4.router()
    reminder = [*CHAT["messages"], {"role": "latest_reminder", "content": "Answer in Celsius."}]
    v4.script([REPLY])
    body = {"model": MODEL, "messages": reminder, "tools": [WEATHER, NOW]} | THINKING
    message = (await post(router, "/v1/chat/completions", body))["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)
    prompt = (await post(router, "/detokenize", {"tokens": v4.last_prompt()}))["prompt"]
    assert prompt == encode_messages(reminder, thinking=True, tools=[WEATHER, NOW])
    assert prompt.endswith("<think><｜latest_reminder｜>Answer in Celsius.")

    max_effort = await post(router, "/tokenize", CHAT | {"reasoning_effort": "max"})
    as_kwarg = CHAT | {"chat_template_kwargs": {"reasoning_effort": "max"}}
    assert (await post(router, "/tokenize", as_kwarg))["tokens"] == max_effort["tokens"]
    both = as_kwarg | {"reasoning_effort": "high"}
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        refused = await http.post("/v1/chat/completions", json=both)
    assert refused.status_code == 400 and "disagree" in refused.json()["error"]["message"]

    renamed = [
        {**m, "reasoning": m.pop("reasoning_content")} if m["role"] == "assistant" else m
        for m in [dict(m) for m in HISTORY]
    ]
    tools = {"tools": [WEATHER, NOW]} | THINKING
    named = await post(router, "/tokenize", {"messages": HISTORY} | tools)
    assert (await post(router, "/tokenize", {"messages": renamed} | tools)) == named
    # Without its reasoning, the earlier turn keeps an empty one: served, not refused.
    bare = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in HISTORY]
    v4.script([REPLY])
    await post(router, "/v1/chat/completions", {"model": MODEL, "messages": bare} | tools)
    prompt = (await post(router, "/detokenize", {"tokens": v4.last_prompt()}))["prompt"]
    assert "</think>Checking." in prompt and "Two tools." not in prompt


@pytest.mark.asyncio
async def test_continuous_usage_stats_and_stop_token_ids(v4: V4) -> None:
    """guidellm's default stream: vLLM's continuous_usage_stats puts the usage so far in every
    chunk; stop_token_ids reach the workers."""
    router = await v4.router()
    v4.script(["Sun", "ny", " and", " warm."])
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = CHAT | {"stream_options": options, "stop_token_ids": [7, 9]}
    chunks = await stream(router, body)
    prompt_tokens = len(v4.last_prompt())
    usages = [c["usage"] for c in chunks if c["choices"]]  # (the last chunk: the final usage)
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    outs = [u["completion_tokens"] for u in usages]
    # (the scripted prefill sends one id, each decode chunk one per byte)
    assert outs == sorted(outs) and outs[0] == 0 and outs[-1] == 1 + len(b"ny and warm.")
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    assert list(v4.prefill.prefill_requests[-1].sampling.stop_token_ids) == [7, 9]
    # Without include_usage it adds nothing, as in vLLM.
    plain = await stream(router, CHAT | {"stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)
