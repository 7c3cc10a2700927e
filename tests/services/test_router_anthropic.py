"""Anthropic's Messages API through the router, with the official `anthropic` SDK, against
scripted gRPC workers that write a V4 reply (reasoning, text, DSML calls): thinking, text and
tool_use blocks whole and streamed, the prompt equal to the chat completion's for the same
conversation (system, tool_use / tool_result history, tools, tool choice), Anthropic's error
shape, and the API key from `x-api-key`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import pytest_asyncio

from dsaserve.engine.text.chat.tokens import DSML as D
from tests.scripted_worker import MODEL, WAIT_S, Scripted, Serve

REASONING = "Two lookups."
TEXT = "On it."
BLOCK = (
    f"\n\n<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Lima</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)
REPLY = f"{REASONING}</think>{TEXT}{BLOCK}"
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
THINKING = {"type": "enabled", "budget_tokens": 1024}
USER = [{"role": "user", "content": "Weather in Lima?"}]
KEY = {"x-api-key": "sk-test"}


@pytest_asyncio.fixture
async def workers(serve: Serve) -> Scripted:
    return Scripted(await serve("prefill", "p1"), await serve("decode", "d1"))


@pytest_asyncio.fixture
async def router(workers: Scripted, make_router: Any, v4_router_model_dir: Path) -> Any:
    return await make_router(model_dir=v4_router_model_dir, api_keys=("sk-test",))


def client(router: Any, key: str = "sk-test") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=router.url, api_key=key, max_retries=0)


@pytest.mark.asyncio
async def test_thinking_text_and_tool_use_whole_and_streamed(
    router: Any, workers: Scripted
) -> None:
    workers.script([REPLY[:5], REPLY[5:30], REPLY[30:80], REPLY[80:]])
    request = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": USER,
        "tools": [WEATHER],
        "thinking": THINKING,
    }
    async with client(router) as c:
        message = await c.messages.create(**request)
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
        thinking, text, call = message.content
        assert (thinking.thinking, text.text) == (REASONING, TEXT)
        assert (call.name, call.input) == ("get_weather", {"city": "Lima", "days": 2})
        assert call.id.startswith("call_") and message.stop_reason == "tool_use"
        assert message.usage.input_tokens == len(workers.last_prompt())
        assert message.id.startswith("msg_")

        async with c.messages.stream(**request) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert [b.model_dump() for b in streamed.content] == [
            b.model_dump() | ({"id": streamed.content[2].id} if b.type == "tool_use" else {})
            for b in message.content
        ]
        assert streamed.stop_reason == "tool_use"
        assert streamed.usage.output_tokens == message.usage.output_tokens


@pytest.mark.asyncio
async def test_the_prompt_is_the_chat_completions(router: Any, workers: Scripted) -> None:
    """A tool loop in Anthropic's blocks renders what the same loop in OpenAI's messages does."""
    workers.script(["Sunny."])
    history = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": REASONING, "signature": ""},
                {"type": "text", "text": TEXT},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Lima"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}],
        },
    ]
    async with client(router) as c:
        message = await c.messages.create(
            model=MODEL,
            max_tokens=50,
            system="Be brief.",
            messages=history,
            tools=[WEATHER],
            thinking=THINKING,
        )
    assert message.content[0].type == "thinking"  # (the reply opened in reasoning)
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *USER,
            {
                "role": "assistant",
                "content": TEXT,
                "reasoning_content": REASONING,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"],
                },
            }
        ],
        "chat_template_kwargs": {"thinking": True},
    }
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        tokens = await http.post("/tokenize", json=chat, headers={"x-api-key": "sk-test"})
    assert tokens.json()["tokens"] == workers.last_prompt()


@pytest.mark.asyncio
async def test_an_assistant_prefill_is_continued(router: Any, workers: Scripted) -> None:
    """A conversation ending with an assistant's text: the prompt opens the assistant turn as
    for a new reply and writes the prefill after it; the answer is only what follows, as on
    Anthropic's API (and on the chat route, vLLM's continue_final_message)."""
    prefill = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    workers.script([" sun", "ny."])
    async with client(router) as c:
        message = await c.messages.create(model=MODEL, max_tokens=20, messages=prefill)
        assert [(b.type, b.text) for b in message.content] == [("text", " sunny.")]  # type: ignore[union-attr]
        async with c.messages.stream(model=MODEL, max_tokens=20, messages=prefill) as stream:
            assert await stream.get_final_text() == " sunny."
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        prompt = workers.last_prompt()
        text = (await http.post("/detokenize", json={"tokens": prompt}, headers=KEY)).json()
        assert text["prompt"].endswith("<｜User｜>Weather in Lima?<｜Assistant｜></think>It is")
        chat = {
            "model": MODEL,
            "messages": [*USER, {"role": "assistant", "content": "It is"}],
            "continue_final_message": True,
            "add_generation_prompt": False,  # (as vLLM wants them)
        }
        answer = await http.post("/v1/chat/completions", json=chat, headers=KEY)
        assert answer.json()["choices"][0]["message"]["content"] == " sunny."
        assert workers.last_prompt() == prompt
        alone = await http.post(
            "/v1/chat/completions", json=chat | {"continue_final_message": False}, headers=KEY
        )
        assert alone.status_code == 400 and "continue_final_message" in alone.text
    async with client(router) as c:
        for messages, extra, says in (
            ([*USER, {"role": "assistant", "content": "It is "}], {}, "trailing whitespace"),
            (prefill, {"thinking": THINKING}, "not served in thinking mode"),
        ):
            with pytest.raises(anthropic.BadRequestError, match=says):
                await c.messages.create(model=MODEL, max_tokens=5, messages=messages, **extra)


@pytest.mark.asyncio
async def test_errors_have_anthropics_shape(router: Any) -> None:
    async with client(router, key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await c.messages.create(model=MODEL, max_tokens=5, messages=USER)
    assert raised.value.body["error"]["type"] == "authentication_error"
    async with client(router) as c:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await c.messages.create(
                model=MODEL,
                max_tokens=5,
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
            )
        assert bad.value.body["type"] == "error"
        assert bad.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError):
            await c.messages.create(model="claude-x", max_tokens=5, messages=USER)
        with pytest.raises(anthropic.BadRequestError, match="temperature"):  # (a bool: no number)
            await c.messages.create(
                model=MODEL, max_tokens=5, messages=USER, extra_body={"temperature": False}
            )
        with pytest.raises(anthropic.BadRequestError, match="tool_use block"):
            await c.messages.create(
                model=MODEL,
                max_tokens=5,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ],
            )
