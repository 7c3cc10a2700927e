"""OpenAI's Responses API through the router, with the official openai client and the OpenAI
Agents SDK's default (Responses) model, against scripted gRPC workers that write a V4 reply:
reasoning, message and function_call items whole and streamed as typed events, tool outputs
and reasoning items fed back, `previous_response_id` continuing a stored conversation (the same
prompt as sending it all), `store: false` storing nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from dsaserve.engine.text.chat.tokens import DSML as D
from tests.scripted_worker import MODEL, Scripted, Serve

REASONING = "Need the weather."
TEXT = "Checking."
CALL = (
    f"\n\n<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Lima</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)
REPLY = f"{REASONING}</think>{TEXT}{CALL}"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
HIGH = {"effort": "high"}


@pytest_asyncio.fixture
async def workers(serve: Serve) -> Scripted:
    return Scripted(await serve("prefill", "p1"), await serve("decode", "d1"))


@pytest_asyncio.fixture
async def client(workers: Scripted, make_router: Any, v4_router_model_dir: Path) -> Any:
    router = await make_router(model_dir=v4_router_model_dir)
    return router.openai()


@pytest.mark.asyncio
async def test_items_whole_and_streamed(client: Any, workers: Scripted) -> None:
    workers.script([REPLY[:4], REPLY[4:25], REPLY[25:70], REPLY[70:]])
    request = {"model": MODEL, "input": "Weather in Lima?", "tools": [WEATHER], "reasoning": HIGH}
    whole = await client.responses.create(**request)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].text == REASONING and whole.output_text == TEXT
    assert (call.name, call.arguments, call.call_id[:5]) == (
        "get_weather",
        '{"city": "Lima"}',
        "call_",
    )
    assert whole.status == "completed" and whole.usage.input_tokens == len(workers.last_prompt())

    stream = await client.responses.create(**request, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (
        REASONING
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == ['{"city": "Lima"}']
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]


@pytest.mark.asyncio
async def test_previous_response_id_continues_the_stored_conversation(
    client: Any, workers: Scripted
) -> None:
    """Continuing from a stored response renders what sending the whole conversation (its
    output items fed back, then the tool output) renders; store: false keeps nothing."""
    workers.script([REPLY])
    first = await client.responses.create(
        model=MODEL, input="Weather in Lima?", tools=[WEATHER], reasoning=HIGH
    )
    call = first.output[-1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    workers.script(["It is sunny."])
    continued = await client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[output],
        tools=[WEATHER],
        reasoning=HIGH,
        instructions="Be brief.",
    )
    continued_prompt = workers.last_prompt()
    assert (await client.responses.retrieve(continued.id)).id == continued.id
    items = [i.model_dump(exclude_none=True) for i in first.output]
    await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Lima?"}, *items, output],
        tools=[WEATHER],
        reasoning=HIGH,
        instructions="Be brief.",
        store=False,
    )
    assert workers.last_prompt() == continued_prompt
    unstored = await client.responses.create(model=MODEL, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError, match="not found"):
        await client.responses.create(model=MODEL, input="Go on", previous_response_id=unstored.id)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        await client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])


@pytest.mark.asyncio
async def test_a_stored_response_is_its_keys_alone_input_items_and_delete(
    workers: Scripted, make_router: Any, v4_router_model_dir: Path
) -> None:
    """Key B gets 404 for key A's response on every route (get, continue, input items,
    delete), as if it did not exist; A lists its input items a page at a time and deletes it."""
    router = await make_router(model_dir=v4_router_model_dir, api_keys=("key-a", "key-b"))
    a, b = router.openai("key-a"), router.openai("key-b")
    workers.script(["Hello."])
    first = await a.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "One"},
            {"role": "assistant", "content": "Two"},
            {"role": "user", "content": [{"type": "input_text", "text": "Three"}]},
        ],
    )
    for attempt in (
        b.responses.retrieve(first.id),
        b.responses.create(model=MODEL, input="Go on", previous_response_id=first.id),
        b.responses.input_items.list(first.id),
        b.responses.delete(first.id),
    ):
        with pytest.raises(openai.NotFoundError, match="not found"):
            await attempt
    assert (await a.responses.retrieve(first.id)).id == first.id
    texts = [item.content[0].text async for item in a.responses.input_items.list(first.id, limit=2)]
    assert texts == ["Three", "Two", "One"]  # (newest first, fetched two at a time)
    page = await a.responses.input_items.list(first.id, order="asc", limit=2)
    assert [i.role for i in page.data] == ["user", "assistant"] and page.has_more
    assert page.data[1].content[0].type == "output_text"
    rest = await a.responses.input_items.list(first.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Three"] and not rest.has_more
    await a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="deleted"):
        await a.responses.retrieve(first.id)


@pytest.mark.asyncio
async def test_agents_sdk_runs_a_tool_loop(client: Any, workers: Scripted) -> None:
    """The Agents SDK's default model: the model calls a tool, the SDK runs it and sends its
    output back, the model answers; run and run_streamed."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # (traces would go to OpenAI's servers)

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        workers.script(["Sunny ", "in Lima."])  # the model's next reply
        return "sunny"

    agent = Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
    )
    workers.script([REPLY])
    result = await Runner.run(agent, "Weather in Lima?")
    assert result.final_output == "Sunny in Lima." and calls == ["Lima"]
    workers.script([REPLY])
    streamed = Runner.run_streamed(agent, "Weather in Lima?")
    async for _ in streamed.stream_events():
        pass
    assert streamed.final_output == "Sunny in Lima." and calls == ["Lima", "Lima"]
