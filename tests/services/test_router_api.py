"""The router's HTTP surface without model workers: validation, auth, models, health, metrics.

Real HTTP through uvicorn and a real redis-server; worker records are registered the way
workers do it (WorkerRegistration), pointing at addresses nothing needs to answer on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from dsaserve.engine.load import Load
from dsaserve.engine.ports import free_port
from dsaserve.engine.text.tokenizer import Tokenizer
from dsaserve.services.registry import WorkerRecord, WorkerRegistration
from dsaserve.services.router.settings import RouterSettings
from tests import REPO_ROOT
from tests.scripted_worker import TOKEN

MODEL = "tiny-router-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

StartRouter = Callable[[RouterSettings], Awaitable[Any]]


@pytest_asyncio.fixture
async def router(start_router: StartRouter, router_model_dir: Path, redis_url: str) -> Any:
    return await start_router(
        RouterSettings(model_dir=str(router_model_dir), redis_url=redis_url, cluster_token=TOKEN)
    )


@pytest_asyncio.fixture
async def http(router: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        yield client


@pytest_asyncio.fixture
async def registered(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[None]]]:
    """Register worker records in Redis, as a worker process would; all are stopped afterwards."""
    regs: list[WorkerRegistration] = []

    async def register(worker_id: str, role: str, layout: str = "L1") -> None:
        rec = WorkerRecord(worker_id, role, "127.0.0.1:9", MODEL, layout, f"agent-{worker_id}")  # type: ignore[arg-type]
        reg = WorkerRegistration(redis_url, rec, Load, TOKEN)
        await reg.start()
        regs.append(reg)

    yield register
    for reg in regs:
        await reg.stop()


def assert_openai_error(
    response: httpx.Response, status: int, *, param: str | None = None, says: str = ""
) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert says.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    return error["message"]


# ---------------------------------------------------------------- 400: invalid input


@pytest.mark.asyncio
async def test_malformed_json_is_400(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, says="not valid JSON")


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"n": 17}, "n", "16"),
        ({"n": 0}, "n", "1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "system"),
        ({"messages": []}, "messages", "at least 1"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "text",
        ),
        ({"temperature": 3.5}, "temperature", "2"),
        ({"temperature": False}, "temperature", "number"),  # a bool is no number on the wire
        ({"presence_penalty": True}, "presence_penalty", "number"),
        ({"max_tokens": 0}, "max_tokens", "1"),
        ({"stream_options": {"include_usage": True}}, None, "stream"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_chat_fields_are_400(
    http: httpx.AsyncClient, patch: dict, param: str | None, says: str
) -> None:
    response = await http.post("/v1/chat/completions", json=CHAT | patch)
    assert_openai_error(response, 400, param=param, says=says)


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"max_tokens": 0}, None, "only allowed with echo"),
        ({"prompt_logprobs": 1, "stream": True}, None, "not available when stream"),
        ({"prompt": ["a", ""]}, "prompt", "batch is empty"),
        ({"prompt": ["a"] * 65}, None, "at most 64"),
        ({"prompt": ["a"] * 5, "n": 16}, None, "at most 64"),
        ({"prompt": [[1, 2], [300]]}, "prompt[1]", "Token ids must be in"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_completion_fields_are_400(
    http: httpx.AsyncClient, patch: dict, param: str | None, says: str
) -> None:
    response = await http.post("/v1/completions", json={"prompt": "hi"} | patch)
    assert_openai_error(response, 400, param=param, says=says)


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"stop": ["ok", "\ud800"]}, "stop[1]"),
        ({"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages[0].content[0].text",
        ),
        ({"model": "\ud800"}, "model"),
        ({"user": "\udc00"}, "user"),
    ],
)
@pytest.mark.asyncio
async def test_lone_surrogates_are_400(http: httpx.AsyncClient, patch: dict, param: str) -> None:
    # json.dumps writes lone surrogates as \uXXXX escapes, as a fuzzer's client would send them.
    body = json.dumps(CHAT | patch).encode()
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, param=param, says="lone UTF-16 surrogate")


@pytest.mark.asyncio
async def test_lone_surrogate_prompt_and_field_name_are_400(http: httpx.AsyncClient) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x\ud800"}).encode()
    response = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, param="prompt", says="surrogate")
    # Not even a field's name may be half a character.
    body = json.dumps(CHAT | {"\ud800": 1}).encode()
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, says="unicode")


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"top_k": 2**31}, "top_k", "2147483647"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"max_tokens": 2**32}, "max_tokens", "4294967295"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens", "4294967295"),
        ({"seed": 2**63}, "seed", "9223372036854775808"),
        ({"seed": -(2**63) - 1}, "seed", "-9223372036854775808"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"top_p": float("inf")}, "top_p", "finite"),
    ],
)
@pytest.mark.asyncio
async def test_numbers_outside_their_wire_range_are_400(
    http: httpx.AsyncClient, patch: dict, param: str, says: str
) -> None:
    body = json.dumps(CHAT | patch).encode()  # NaN and Infinity as Python's json writes them
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, param=param, says=says)


@pytest.mark.parametrize(
    ("route", "patch", "param", "says"),
    [
        ("chat", {"logits_processors": ["my.Processor"]}, "logits_processors", "null"),
        ("chat", {"length_penalty": 0.5}, "length_penalty", "not supported"),
        ("chat", {"functions": [{"name": "f"}]}, "functions", "not supported"),
        ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, None, "name"),
        (
            "chat",
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "not supported",
        ),
        ("completion", {"best_of": 2}, "best_of", "not supported"),
        ("chat", {"echo": True}, "echo", "not supported"),
        ("completion", {"use_beam_search": True}, "use_beam_search", "not supported"),
        ("chat", {"chat_template": "{{ x }}"}, "chat_template", "not supported"),
        ("chat", {"temprature": 0.5}, "temprature", "unrecognized request argument"),
        ("completion", {"messages": []}, "messages", "unrecognized request argument"),
    ],
)
@pytest.mark.asyncio
async def test_unimplemented_and_unknown_fields_are_400_by_name(
    http: httpx.AsyncClient, route: str, patch: dict, param: str | None, says: str
) -> None:
    if route == "chat":
        response = await http.post("/v1/chat/completions", json=CHAT | patch)
    else:
        response = await http.post("/v1/completions", json={"prompt": "hi"} | patch)
    message = assert_openai_error(response, 400, param=param, says=says)
    assert (param or "name") in message


@pytest.mark.asyncio
async def test_no_op_values_of_unimplemented_fields_are_accepted(http: httpx.AsyncClient) -> None:
    no_ops = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": False,
        "top_logprobs": None,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "user-42",
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": []}],
    }
    # Past validation, tokenization and the wire message, to the 503 of an empty registry.
    response = await http.post("/v1/chat/completions", json=CHAT | no_ops)
    assert_openai_error(response, 503, says="no live prefill")
    text = {"prompt": "hi", "logit_bias": None, "echo": False, "best_of": 1, "suffix": ""}
    assert_openai_error(await http.post("/v1/completions", json=text), 503)


@pytest.mark.asyncio
async def test_missing_messages_is_400(http: httpx.AsyncClient) -> None:
    assert_openai_error(
        await http.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages"
    )


@pytest.mark.asyncio
async def test_chat_template_refusal_is_400(http: httpx.AsyncClient) -> None:
    # The tiny model's template has no tool role and says so through raise_exception.
    body = CHAT | {"messages": [{"role": "tool", "content": "42"}]}
    assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="messages", says="tool"
    )


@pytest.mark.asyncio
async def test_prompt_over_context_is_400(http: httpx.AsyncClient) -> None:
    body = CHAT | {"messages": [{"role": "user", "content": "x" * 100}]}
    message = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="messages"
    )
    assert (
        "maximum context length is 64 tokens" in message and "103 tokens" in message
    )  # bos, User, 100 x, Assistant

    message = assert_openai_error(
        await http.post("/v1/completions", json={"prompt": list(range(64))}), 400, param="prompt"
    )
    assert "64 tokens" in message


@pytest.mark.asyncio
async def test_prompt_plus_max_tokens_over_context_is_400(http: httpx.AsyncClient) -> None:
    body = CHAT | {"max_completion_tokens": 60}  # the prompt is 5 tokens: 5 + 60 > 64
    message = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="max_tokens"
    )
    assert "65 tokens" in message and "at most 59" in message


@pytest.mark.asyncio
async def test_prompt_that_cannot_fit_is_refused_before_tokenizing(
    http: httpx.AsyncClient,
) -> None:
    # No token of the tiny tokenizer covers more than 21 characters (its bos token), so 2000
    # characters are at least 96 tokens: over the 64-token context without counting them.
    chat = CHAT | {"messages": [{"role": "user", "content": "x" * 2000}]}
    message = assert_openai_error(
        await http.post("/v1/chat/completions", json=chat), 400, param="messages"
    )
    assert "at least 98 tokens" in message  # the rendered prompt: bos, turn markers, text
    response = await http.post("/v1/completions", json={"prompt": "x" * 2000})
    message = assert_openai_error(response, 400, param="prompt", says="at least 96 tokens")
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.asyncio
async def test_body_over_max_request_bytes_is_413(
    start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    exact = json.dumps(CHAT).encode()
    router = await start_router(
        RouterSettings(
            str(router_model_dir), redis_url, cluster_token=TOKEN, max_request_bytes=len(exact)
        )
    )
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        json_headers = {"content-type": "application/json"}
        # At the limit: read, validated, on to the 503 of an empty registry.
        response = await http.post("/v1/chat/completions", content=exact, headers=json_headers)
        assert response.status_code == 503
        # One byte over, declared in Content-Length: refused before reading.
        response = await http.post(
            "/v1/chat/completions", content=exact + b" ", headers=json_headers
        )
        assert_openai_error(response, 413, says=f"at most {len(exact)} bytes")

    # No Content-Length, and no end (chunked): counted as it arrives and refused there, while
    # the client is still sending. Without the limit the router would wait for the end.
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        head = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        chunk, sent = 1 << 16, 0
        while not head.done():
            assert sent < 1 << 26, "no answer while 64 MiB of body kept coming"
            writer.write(b"%x\r\n%s\r\n" % (chunk, b" " * chunk))
            await writer.drain()
            await asyncio.sleep(0)  # a turn for the router, which runs on this event loop
            sent += chunk
        assert head.result().startswith(b"HTTP/1.1 413 ")
        length = next(
            int(line.split(b":")[1])
            for line in head.result().split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        error = json.loads(await reader.readexactly(length))["error"]
        assert error["code"] == "request_too_large" and "longer" in error["message"]
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([5, 9999], "[0, 262)"),
        ("", "empty"),
        ([], "empty"),
        ([[1, 2], []], "batch is empty"),
        ([1, "a"], "valid integer"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_completion_prompts_are_400(
    http: httpx.AsyncClient, prompt: Any, says: str
) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert_openai_error(response, 400, says=says)
    assert response.json()["error"]["param"].startswith("prompt")


# ---------------------------------------------------------------- 400: tools, thinking, logprobs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest_asyncio.fixture
async def v4_http(
    start_router: StartRouter, v4_router_model_dir: Path, redis_url: str
) -> AsyncIterator[httpx.AsyncClient]:
    """A router whose checkpoint has no template: chats use the V4 release's encoder."""
    router = await start_router(
        RouterSettings(str(v4_router_model_dir), redis_url, cluster_token=TOKEN)
    )
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        yield client


V4_CHAT = {"model": "tiny-v4-router-model", "messages": [{"role": "user", "content": "hi"}]}
# A strict schema's keyword the grammar library does not implement, and a strict tool's
# parameters that are no plain object of named properties.
IF_SCHEMA = {"type": "object", "if": {"required": ["a"]}, "then": {}}
STRICT_IF = {"name": "conditional", "strict": True, "schema": IF_SCHEMA}
STRICT_PATTERN_TOOL = {
    "name": "lookup",
    "strict": True,
    "parameters": {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
SELF_REF = {"name": "loop", "schema": {"$ref": "#"}}  # (no value of it ends)


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0].type", ""),
        (
            {"tools": [{"type": "function", "function": {"name": 'a"b'}}]},
            "tools[0].function.name",
            "pattern",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", ""),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g', which is not in tools",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": STRICT_IF}},
            "response_format.json_schema.schema",
            'Unimplemented keys: ["if", "then"]',
        ),
        (
            {"tools": [{"type": "function", "function": STRICT_PATTERN_TOOL}]},
            "tools[0].function.parameters",
            "'patternProperties' is not supported",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": SELF_REF}},
            "response_format.json_schema.schema",
            "no finite instance: every value of '#' must contain another",
        ),
        ({"response_format": {"type": "json"}}, "response_format", ""),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "'max'"),
        (
            {"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}},
            "reasoning_effort",
            "turns thinking off",
        ),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs", "true or false"),
        (
            {"chat_template_kwargs": {"thinking": True, "enable_thinking": False}},
            "chat_template_kwargs",
            "disagree",
        ),
        (
            {"chat_template_kwargs": {"temperature_hint": 1}},
            "chat_template_kwargs.temperature_hint",
            "drop_thinking",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
            "messages[0]",
            "'tool_calls' belongs on assistant messages",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]},
            "messages[0]",
            "belongs on tool messages",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
            "required",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "messages[1]",
            "must end with a user or tool message",
        ),
    ],
)
@pytest.mark.asyncio
async def test_invalid_tools_thinking_and_logprobs_are_400(
    v4_http: httpx.AsyncClient, patch: dict, param: str, says: str
) -> None:
    response = await v4_http.post("/v1/chat/completions", json=V4_CHAT | patch)
    assert_openai_error(response, 400, param=param, says=says)


@pytest.mark.parametrize(
    "patch",
    [
        {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False},
        {"tools": [WEATHER], "tool_choice": "required"},
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": WEATHER["function"]["name"]}},
        },
        {"tools": [WEATHER], "tool_choice": "none", "reasoning_effort": "max"},
        {"tools": [WEATHER], "tool_choice": "required", "reasoning_effort": "high"},
        {"response_format": {"type": "json_object"}, "reasoning_effort": "high"},
        # not strict: what the grammar library does not implement is left out
        {"response_format": {"type": "json_schema", "json_schema": STRICT_IF | {"strict": False}}},
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"drop_thinking": False}, "logprobs": True, "top_logprobs": 20},
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        },
        {"n": 16, "seed": 3},
    ],
)
@pytest.mark.asyncio
async def test_valid_tools_thinking_and_logprobs_reach_the_workers(
    v4_http: httpx.AsyncClient, patch: dict
) -> None:
    # Past validation and rendering, to the 503 of an empty registry.
    response = await v4_http.post("/v1/chat/completions", json=V4_CHAT | patch)
    assert_openai_error(response, 503, says="no live prefill")


@pytest.mark.asyncio
async def test_tools_a_template_never_reads_are_400(http: httpx.AsyncClient) -> None:
    # The tiny model's Jinja template has no tools section: the model would never see them.
    response = await http.post("/v1/chat/completions", json=CHAT | {"tools": [WEATHER]})
    assert_openai_error(response, 400, param="tools", says="does not render tools")
    # Without tools a template takes tool_choice "none"/"auto" (client libraries send them).
    for choice in ("none", "auto"):
        response = await http.post("/v1/chat/completions", json=CHAT | {"tool_choice": choice})
        assert_openai_error(response, 503)
    response = await http.post("/v1/completions", json={"prompt": "hi", "logprobs": 21})
    assert_openai_error(response, 400, param="logprobs", says="20")
    # A template variable may not replace what the router passes a template.
    body = CHAT | {"chat_template_kwargs": {"messages": []}}
    response = await http.post("/v1/chat/completions", json=body)
    assert_openai_error(response, 400, says="may not be named messages")


# ---------------------------------------------------------------- /tokenize, /detokenize


@pytest.mark.asyncio
async def test_tokenize_renders_chats_and_prompts_as_generation_does(
    http: httpx.AsyncClient, router_model_dir: Path
) -> None:
    tokenizer = Tokenizer.from_pretrained(router_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    response = await http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    expected = tokenizer.encode_chat(messages)
    assert response.json() == {
        "count": len(expected),
        "max_model_len": 64,
        "tokens": expected,
        "token_strs": None,
    }
    without = await http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    )
    assert without.json()["tokens"] == expected[:-1]  # no trailing <｜Assistant｜>

    text = await http.post("/tokenize", json={"prompt": "hé", "return_token_strs": True})
    assert text.json()["tokens"] == [256, ord("h"), 0xC3, 0xA9]  # bos, then one token per byte
    # Each token's own bytes: half a character shows as U+FFFD.
    assert text.json()["token_strs"] == ["<｜begin▁of▁sentence｜>", "h", "\ufffd", "\ufffd"]
    bare = await http.post("/tokenize", json={"prompt": "hé", "add_special_tokens": False})
    assert bare.json()["tokens"] == [ord("h"), 0xC3, 0xA9]

    back = await http.post("/detokenize", json={"tokens": expected})
    assert back.json() == {"prompt": tokenizer.decode(expected, skip_special_tokens=False)}
    assert back.json()["prompt"].startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi")


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/detokenize", {"tokens": [1, 262]}, 400, "tokens", "[0, 262)"),
        ("/detokenize", {"tokens": []}, 400, "tokens", "at least 1"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
        ("/tokenize", {"prompt": "hi", "tools": []}, 400, "tools", "unrecognized"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "tool"),
        ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "gpt-9"),
        ("/tokenize", {}, 400, "prompt", "required"),
        # JSON booleans only, as the schema says (lax pydantic took 0 and 1)
        ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, 400, "return_token_strs", "bool"),
    ],
)
@pytest.mark.asyncio
async def test_tokenize_errors(
    http: httpx.AsyncClient, path: str, body: dict, status: int, param: str, says: str
) -> None:
    assert_openai_error(await http.post(path, json=body), status, param=param, says=says)


@pytest.mark.asyncio
async def test_tokenize_with_the_v4_encoder(v4_http: httpx.AsyncClient) -> None:
    body = V4_CHAT | {"reasoning_effort": "max", "tools": [WEATHER]}
    response = await v4_http.post("/tokenize", json=body | {"return_token_strs": True})
    assert response.status_code == 200, response.text
    text = "".join(response.json()["token_strs"])
    assert text.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert '"name": "get_weather"' in text and text.endswith("<｜User｜>hi<｜Assistant｜><think>")
    response = await v4_http.post("/tokenize", json=body | {"add_generation_prompt": False})
    assert_openai_error(response, 400, param="add_generation_prompt", says="must be true")


# ---------------------------------------------------------------- 401 / 404


@pytest.mark.asyncio
async def test_api_keys(start_router: StartRouter, router_model_dir: Path, redis_url: str) -> None:
    router = await start_router(
        RouterSettings(str(router_model_dir), redis_url, cluster_token=TOKEN, api_keys=("k1", "k2"))
    )
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
        assert_openai_error(await http.post("/v1/chat/completions", json=CHAT), 401, says="API key")
        wrong = {"Authorization": "Bearer nope"}
        assert_openai_error(await http.post("/v1/chat/completions", json=CHAT, headers=wrong), 401)
        assert_openai_error(
            await http.get("/v1/models", headers={"Authorization": "Basic k1"}), 401
        )
        assert (
            await http.get("/v1/models", headers={"Authorization": "Bearer k2"})
        ).status_code == 200
        # A right key gets past authentication (to the 503 of an empty registry).
        right = {"Authorization": "Bearer k1"}
        assert (
            await http.post("/v1/chat/completions", json=CHAT, headers=right)
        ).status_code == 503
        assert (await http.get("/health")).status_code == 503  # probes need no key

    client = router.openai(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()


@pytest.mark.asyncio
async def test_unknown_model_is_404(router: Any) -> None:
    client = router.openai()
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found"
    assert MODEL in info.value.message


@pytest.mark.asyncio
async def test_unknown_route_is_404(http: httpx.AsyncClient) -> None:
    assert_openai_error(await http.get("/v1/engines"), 404, says="unknown route")
    response = await http.get("/v1/chat/completions")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"


# ---------------------------------------------------------------- 503, /health, /v1/models


@pytest.mark.asyncio
async def test_no_workers_is_503(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(response, 503, says="no live prefill or decode worker")
    # A worker shows up at the watcher's next refresh, every TTL/2 (3 s by default).
    assert response.headers["retry-after"] == "3"


@pytest.mark.asyncio
async def test_only_prefill_is_503_naming_decode(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill")
    await router.refresh_registry()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    message = assert_openai_error(response, 503, says="no live decode worker")
    assert "prefill" not in message.split("dsaserve")[0]


@pytest.mark.asyncio
async def test_layout_mismatch_is_503(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill", layout="L1")
    await registered("d1", "decode", layout="L2")
    await router.refresh_registry()
    assert_openai_error(await http.post("/v1/chat/completions", json=CHAT), 503, says="KV layout")
    health = await http.get("/health")
    assert health.status_code == 503 and "KV layout" in health.json()["message"]


@pytest.mark.asyncio
async def test_health_needs_both_roles(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    response = await http.get("/health")
    assert response.status_code == 503
    assert response.json()["workers"] == {"prefill": 0, "decode": 0}
    live = await http.get("/live")  # the process answers whether or not it can serve
    assert live.status_code == 200 and live.json() == {"status": "ok"}

    await registered("d1", "decode")
    await router.refresh_registry()
    response = await http.get("/health")
    assert (
        response.status_code == 503
        and "no live prefill worker" in response.json()["message"].lower()
    )

    await registered("p1", "prefill")
    await router.refresh_registry()
    response = await http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body.pop("registry")["up"] is True
    assert body == {
        "status": "ok",
        "model": MODEL,
        "workers": {"prefill": 1, "decode": 1},
        "unhealthy_workers": {"prefill": 0, "decode": 0},
    }


@pytest.mark.asyncio
async def test_models_lists_the_served_model(
    router: Any, start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    client = router.openai()
    models = (await client.models.list()).data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 64
    assert str(router_model_dir) not in models[0].model_dump_json()  # no path of the server's

    renamed = await start_router(
        RouterSettings(
            str(router_model_dir), redis_url, cluster_token=TOKEN, served_model_name="deepseek-v4"
        )
    )
    async with httpx.AsyncClient(base_url=renamed.url) as http:
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "deepseek-v4"


# ---------------------------------------------------------------- /openapi.json


@pytest.mark.asyncio
async def test_openapi_lists_the_error_responses_the_router_sends(
    http: httpx.AsyncClient,
) -> None:
    schema = (await http.get("/openapi.json")).json()
    assert "422" not in json.dumps(schema["paths"])  # FastAPI's default; the router sends 400
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "503", "504", "default"}
        for status in ("400", "413", "503", "default"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorBody")
        assert (
            set(responses["429"]["headers"]) == set(responses["503"]["headers"]) == {"Retry-After"}
        )
    assert set(schema["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "default"}
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    # Unknown fields are refused, and the schema says so.
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    # What a field takes is what the schema says it takes: `stop` a string, a list or null.
    assert [t["type"] for t in chat["properties"]["stop"]["anyOf"]] == ["string", "array", "null"]


# ---------------------------------------------------------------- /metrics


@pytest.mark.asyncio
async def test_metrics_parse_and_count_outcomes(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill")
    await router.refresh_registry()
    await http.post("/v1/chat/completions", json=CHAT | {"n": 30})
    await http.post("/v1/chat/completions", json=CHAT)  # 503: no decode worker

    response = await http.get("/metrics")
    assert response.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    chat = ("endpoint", "/v1/chat/completions")
    assert samples[("dsaserve_router_requests_total", (chat, ("status", "400")))] == 1
    assert samples[("dsaserve_router_requests_total", (chat, ("status", "503")))] == 1
    assert samples[("dsaserve_router_failures_total", (("cause", "no_worker"),))] == 1
    assert samples[("dsaserve_router_live_workers", (("role", "prefill"),))] == 1
    assert samples[("dsaserve_router_live_workers", (("role", "decode"),))] == 0
    assert samples[("dsaserve_router_queue_depth", ())] == 0
    assert samples[("dsaserve_router_inflight_requests", ())] == 0
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert samples[(f"dsaserve_router_{histogram}_count", ())] == 0
    assert samples[("dsaserve_router_prompt_tokens_total", ())] == 0


# ---------------------------------------------------------------- exposure


async def _startup_log(argv: list[str]) -> str:
    """`dsaserve router ARGV`'s output up to uvicorn's "running on" line; then it is stopped."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dsaserve.services.cli",
        "router",
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "DSASERVE_CLUSTER_TOKEN": TOKEN},
    )
    lines: list[str] = []
    try:
        while not lines or "Uvicorn running on" not in lines[-1]:
            line = await asyncio.wait_for(proc.stderr.readline(), timeout=60)
            assert line, "the router exited:\n" + "".join(lines)
            lines.append(line.decode())
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)
    return "".join(lines)


@pytest.mark.asyncio
@pytest.mark.e2e  # a dsaserve command as a process
async def test_router_binds_loopback_unless_told_and_warns_when_open(
    router_model_dir: Path, redis_url: str
) -> None:
    common = ["--model", str(router_model_dir), "--redis-url", redis_url]
    log = await _startup_log([*common, "--port", str(free_port())])
    assert "Uvicorn running on http://127.0.0.1:" in log
    assert "WITHOUT AUTHENTICATION" not in log

    log = await _startup_log([*common, "--host", "0.0.0.0", "--port", str(free_port())])
    assert "Uvicorn running on http://0.0.0.0:" in log
    warning = next(line for line in log.splitlines() if "WITHOUT AUTHENTICATION" in line)
    assert " WARNING " in warning and "--api-key" in warning

    keyed = [*common, "--host", "0.0.0.0", "--port", str(free_port()), "--api-key", "k"]
    assert "WITHOUT AUTHENTICATION" not in await _startup_log(keyed)


# ---------------------------------------------------------------- torch-free


# The engine modules the router may import: engine.text and these torch-free leaves.
ROUTER_ENGINE_MODULES = (
    "dsaserve.engine.model_dir",
    "dsaserve.engine.config",
    "dsaserve.engine.prefix_cache",
    "dsaserve.engine.prefix_cache.block_hash",
    "dsaserve.engine.load",
    "dsaserve.engine.sampling_params",
    "dsaserve.engine.speculative",
    "dsaserve.engine.speculative.config",
)


def test_router_imports_without_torch() -> None:
    code = (
        "import sys, dsaserve.services.router, dsaserve.services.router.main\n"
        "import dsaserve.services.registry, dsaserve.services.cli\n"
        "from dsaserve.services.cli import build_parser; build_parser('router')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        f"allowed = ('dsaserve.engine', 'dsaserve.engine.text', *{ROUTER_ENGINE_MODULES!r})\n"
        "engine = [m for m in sys.modules if m.startswith('dsaserve.engine')]\n"
        "beyond = [m for m in engine\n"
        "          if m not in allowed and not m.startswith('dsaserve.engine.text.')]\n"
        "assert not beyond, f'the router imports torch-side engine modules: {beyond}'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- slow and idle connections


@pytest.mark.asyncio
async def test_stalled_connections_are_closed_while_other_clients_are_served(
    start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    cap = 6
    router = await start_router(
        RouterSettings(
            str(router_model_dir),
            redis_url,
            cluster_token=TOKEN,
            header_read_timeout_s=0.5,
            body_read_timeout_s=0.5,
            max_connections=cap,
        )
    )
    port = int(router.url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    stalls = (b"", head, head + b"Content-Length: 100\r\n\r\n" + b'{"model"')  # idle, half, body
    stalled = []
    for payload in stalls:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        stalled.append((reader, writer))
    trickler_reader, trickler = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:  # a byte of a head every 0.1 s: never complete, never idle
        for byte in head * 100:
            trickler.write(bytes([byte]))
            await asyncio.sleep(0.1)

    trickling = asyncio.ensure_future(trickle())
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
            for _ in range(3):  # served meanwhile
                assert (await http.get("/v1/models")).status_code == 200
        for reader, _ in [*stalled, (trickler_reader, trickler)]:
            with contextlib.suppress(ConnectionResetError):  # (closed while we wrote: a RST)
                assert await asyncio.wait_for(reader.read(), timeout=20) == b""  # closed by it
    finally:
        trickling.cancel()
        for _, writer in [*stalled, (trickler_reader, trickler)]:
            writer.close()

    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # one over the cap
        refused = await asyncio.wait_for(reader.read(), timeout=20)
        writer.close()
        assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in refused
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
            "too_many_connections"
        )
    finally:
        for _, writer in idle:
            writer.close()


@pytest.mark.asyncio
async def test_a_request_head_over_its_bounds_gets_431_and_a_large_body_still_passes(
    start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    router = await start_router(
        RouterSettings(str(router_model_dir), redis_url, cluster_token=TOKEN)
    )
    port = int(router.url.rsplit(":", 1)[1])

    async def exchange(payload: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(payload)
            with contextlib.suppress(ConnectionResetError):  # (closed while we wrote: a RST)
                await writer.drain()
            return await asyncio.wait_for(reader.read(), timeout=20)
        finally:
            writer.close()

    huge = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    many = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%d: v\r\n" % i for i in range(150)
    )
    for payload in (huge, many + b"\r\n"):
        refused = await exchange(payload)
        assert refused.startswith(b"HTTP/1.1 431"), refused[:200]
        error = json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_header_fields_too_large"
        assert "--h11-max-incomplete-event-size" in error["message"]
    # A small head with a body far over the head bound, sent in one write, is read as usual
    # (here to the app's own 400: the prompt is longer than the context).
    body = json.dumps({"prompt": "x" * (200 << 10)}).encode()
    answered = await exchange(
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    assert answered.startswith(b"HTTP/1.1 400") and b"context_length_exceeded" in answered
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
        assert (await http.get("/v1/models")).status_code == 200  # and it serves on


@pytest.mark.asyncio
async def test_a_slow_live_body_is_served_and_an_idle_kept_alive_connection_is_closed(
    start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    """The body deadline is renewed by each piece (a body trickled over 1.2 s with 0.5 s
    deadlines is read whole); after the response the next request head is owed again."""
    router = await start_router(
        RouterSettings(
            str(router_model_dir),
            redis_url,
            cluster_token=TOKEN,
            header_read_timeout_s=0.5,
            body_read_timeout_s=0.5,
        )
    )
    port = int(router.url.rsplit(":", 1)[1])
    prompt = {"prompt": "hello there, slowly"}
    body = json.dumps(prompt).encode()
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
        expected = (await http.post("/tokenize", json=prompt)).json()["tokens"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        for at in range(0, len(body), 8):  # a piece every 0.3 s: longer than either deadline
            await asyncio.sleep(0.3)
            writer.write(body[at : at + 8])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        assert json.loads(await reader.readexactly(length))["tokens"] == expected
        # kept alive, it owes the next request head: closed once the header deadline passes
        # (well before uvicorn's own 5 s keep-alive timeout)
        assert await asyncio.wait_for(reader.read(), timeout=3) == b""
    finally:
        writer.close()
