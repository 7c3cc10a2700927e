"""Chat formats against DeepSeek's own prompt library, `deepseek-recipe`.

DeepSeek-V4.1 prompts are the library's (engine.text.chat.recipe): a chat rendered through our
chat format equals what the library makes of the same Chat Completions request on its own, on
conversations with tools, thinking, every reasoning effort, latest reminders and multi-turn
reasoning. DeepSeek-V4 keeps the release's encoder: the library's V4 encoding (DeepSeek's API
format for V4-Pro) equals it where the two formats agree, and each place they part is pinned
here, so a library release that moves either way is noticed. Replies: our parser reads each
dialect as the library's stream processor does.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
import pytest

from dsaserve.engine.text.chat import V4_DSML, V41_DSML, encode_messages, parse_completion
from dsaserve.engine.text.chat.dsml import Dialect, tool_calls_block
from dsaserve.engine.text.chat_format import REASONING_EFFORTS, ChatOptions, V41Chat, chat_format
from dsaserve.engine.text.tokenizer import Tokenizer
from tests.text.test_chat_encoding_dsv4 import TOOLS

V41 = "DeepSeek-V4.1-Flash"
V4 = "DeepSeek-V4-Pro"


def call(i: int, name: str, arguments: Mapping[str, Any]) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


CONVERSATIONS: dict[str, list[dict]] = {
    "plain": [{"role": "user", "content": "hi"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    "developer": [{"role": "developer", "content": "D"}, {"role": "user", "content": "hi"}],
    "multi_turn_with_reasoning": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "thought"},
        {"role": "user", "content": "c"},
    ],
    "text_parts": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    "unicode": [{"role": "system", "content": "日本語 ✓"}, {"role": "user", "content": "naïve 😀"}],
    "tool_loop": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need it",
            "tool_calls": [call(1, "get_time", {"city": "Paris"})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ],
    "parallel_calls": [
        {"role": "user", "content": "both?"},
        {
            "role": "assistant",
            "content": "On it.",
            "reasoning_content": "two",
            "tool_calls": [
                call(1, "get_time", {"city": "Paris"}),
                call(2, "convert", {"amount": 3.5, "to": {"n": [1, "ü"]}}),
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "3 EUR"},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "assistant", "content": "Noon; 3 EUR.", "reasoning_content": "done"},
        {"role": "user", "content": "thanks"},
    ],
    "latest_reminder": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "r"},
        {"role": "user", "content": "Bye"},
        {"role": "latest_reminder", "content": "Today is Friday."},
    ],
}


def library_prompt(model: str, body: Mapping[str, Any]) -> str:
    """What the library makes of a Chat Completions request on its own (it names no
    `developer` role: OpenAI's system role for reasoning models, sent as one)."""
    messages = [
        {**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]
    ]
    request = recipe.ChatCompletionRequest({"model": model, **body, "messages": messages})
    conversation = request.convert(recipe.ConversionOptions()).conversation
    encoding = recipe.DeepseekV41Encoding() if model == V41 else recipe.DeepseekV4Encoding()
    return encoding.render_conversation(conversation).prompt


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V4.1 checkpoint's config and tokenizer, as far as the chat format reads them."""
    from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer

    path = tmp_path_factory.mktemp("v41_chat")
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    write_byte_tokenizer(path, release=True)
    return path


def test_a_v41_checkpoint_without_a_template_gets_the_library(v41_dir: Path) -> None:
    fmt = chat_format(v41_dir, Tokenizer.from_pretrained(v41_dir))
    assert isinstance(fmt, V41Chat) and fmt.dialect == V41_DSML


@pytest.mark.parametrize(
    ("name", "thinking", "effort", "tools"),
    [
        (name, thinking, effort, tools)
        for name, thinking, effort, tools in itertools.product(
            CONVERSATIONS, (False, True), (None, *REASONING_EFFORTS), (False, True)
        )
        if thinking or effort is None
    ],
)
def test_v41_prompts_are_the_librarys(name: str, thinking: bool, effort: str | None, tools: bool):
    """Every conversation, thinking on and off, every OpenAI effort (DeepSeek's four levels and
    the two OpenAI names DeepSeek lacks, "minimal" -> low and "medium" -> high), with and
    without tools: our format's prompt is the one the library makes of the same request."""
    messages = CONVERSATIONS[name]
    rendered = V41Chat().render(
        messages,
        tools=TOOLS if tools else None,
        options=ChatOptions(thinking=thinking, reasoning_effort=effort),
    )
    body: dict[str, Any] = {
        "messages": messages,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if effort is not None:
        body["reasoning_effort"] = {"minimal": "low", "medium": "high"}.get(effort, effort)
    if tools:
        body["tools"] = TOOLS
    assert rendered == library_prompt(V41, body)


def test_v41_effort_is_a_number_on_the_first_turn_only() -> None:
    """The levels' numbers and the default in thinking mode are the library's (DeepSeek's API
    maps low/high/max to 50/75/100 too); the effort is written once, in the first system turn,
    however many turns follow; chat mode writes none."""
    messages = CONVERSATIONS["multi_turn_with_reasoning"]

    def effort_lines(prompt: str) -> list[str]:
        return [line for line in prompt.splitlines() if "Reasoning Effort" in line]

    levels = {}
    for effort in (None, *REASONING_EFFORTS):
        prompt = V41Chat().render(messages, options=ChatOptions(True, effort))
        assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: ")
        (line,) = effort_lines(prompt)
        levels[effort] = int(line.split(": ")[1].split()[0])
    assert levels == {
        None: 75,
        "minimal": 50,
        "low": 50,
        "medium": 75,
        "high": 75,
        "xhigh": 75,
        "max": 100,
    }
    assert effort_lines(V41Chat().render(messages, options=ChatOptions(False, "max"))) == []


def test_v41_tool_calls_are_written_in_spaced_dsml() -> None:
    prompt = V41Chat().render(CONVERSATIONS["tool_loop"], tools=TOOLS)
    block = tool_calls_block([("get_time", {"city": "Paris"})], V41_DSML)
    assert block in prompt and "<｜DSML｜ calls>" in block and "<｜DSML｜tool_calls>" not in prompt


def test_v41_refuses_images_by_name(v41_dir: Path) -> None:
    from dsaserve.engine.text.chat import ChatEncodingError

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ChatEncodingError, match="vision tower is not loaded") as err:
        V41Chat().render([{"role": "user", "content": [image]}])
    assert err.value.param == "messages[0].content[0]"


# The open V4 release's encoder against the library's V4 encoding (DeepSeek's API format for
# V4-Pro): equal where the two formats agree ...
V4_AGREEING = ("plain", "system", "developer", "multi_turn_with_reasoning", "text_parts")
V4_AGREEING_WITH_TOOLS = ("tool_loop", "parallel_calls")


@pytest.mark.parametrize(
    ("name", "thinking", "effort"),
    list(itertools.product(V4_AGREEING + V4_AGREEING_WITH_TOOLS, (False, True), (None, "max"))),
)
def test_v4_release_encoder_agrees_with_the_librarys_v4_encoding(
    name: str, thinking: bool, effort: str | None
) -> None:
    """Where the formats agree, every effort: the release's "max" paragraph is the library's
    "high", and what the release writes for no effort the library writes for "low"."""
    tools = TOOLS if name in V4_AGREEING_WITH_TOOLS else None
    messages = CONVERSATIONS[name]
    ours = encode_messages(messages, thinking=thinking, reasoning_effort=effort, tools=tools)
    body: dict[str, Any] = {
        "messages": messages,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if thinking:
        body["reasoning_effort"] = "high" if effort == "max" else "low"
    if tools:
        body["tools"] = tools
    assert ours == library_prompt(V4, body)


def test_v4_where_the_release_and_the_librarys_v4_encoding_part() -> None:
    """... and each place they part (why V4 keeps the release's encoder: recipe's docstring)."""

    def both(messages: list[dict], thinking: bool = True, tools: Sequence | None = None):
        body: dict[str, Any] = {
            "messages": messages,
            "thinking": {"type": "enabled" if thinking else "disabled"},
        }
        if thinking:
            body["reasoning_effort"] = "low"
        if tools:
            body["tools"] = tools
        return encode_messages(messages, thinking=thinking, tools=tools), library_prompt(V4, body)

    reminder = "<｜latest_reminder｜>Today is Friday."
    ours, theirs = both(CONVERSATIONS["latest_reminder"])
    assert ours.endswith("<｜Assistant｜><think>" + reminder)  # after the assistant's opening
    assert theirs.endswith(reminder + "<｜Assistant｜><think>")  # before it
    two = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}]
    ours, theirs = both([*two, {"role": "user", "content": "x"}])
    assert "AB<｜User｜>" in ours and "A\n\nB<｜User｜>" in theirs
    extra = [{"type": "function", "function": {"name": "f", "strict": True}}]
    ours, theirs = both(CONVERSATIONS["plain"], tools=extra)
    assert '{"name": "f", "strict": true}' in ours  # the client's function object as it is
    assert '{"name": "f", "description": "", "parameters": {"type": "object", ' in theirs
    no_args = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "get_time", {})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ]
    ours, theirs = both(no_args, tools=TOOLS)
    assert 'name="get_time">\n\n</｜DSML｜invoke>' in ours
    assert 'name="get_time">\n</｜DSML｜invoke>' in theirs


def library_reply(model: str, text: str, thinking: bool) -> tuple[str, str, list[tuple]]:
    """(reasoning, content, [(tool name, arguments)]) the library's stream processor reads from
    a completion streamed a few characters at a time."""
    body = {"model": model, "messages": [{"role": "user", "content": "q"}], "tools": TOOLS}
    body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    generator = recipe.ChatCompletionRequest.chunk_generator(request, "id", model)
    processor = recipe.StreamProcessor(generator, request.parsing_options)
    chunks = processor.push(recipe.InferenceChunk.ready())
    for i in range(0, len(text), 3):
        chunks += processor.push(recipe.InferenceChunk.text(text[i : i + 3], 1))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    chunks += processor.finish()
    reasoning, content, calls = "", "", dict[int, list[str]]()
    for chunk in chunks:
        delta = json.loads(chunk.to_json())["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for c in delta.get("tool_calls") or []:
            calls.setdefault(c["index"], []).extend(
                [c["function"].get("name") or "", c["function"].get("arguments") or ""]
            )
    return reasoning, content, [(p[0], json.loads("".join(p[1:]))) for p in calls.values()]


def completion(dialect: Dialect, thinking: bool) -> str:
    calls = [("get_time", {"city": "Paris"}), ("convert", {"amount": 3.5, "to": {"n": [1]}})]
    return (
        ("Let me check.</think>" if thinking else "") + "Sure." + tool_calls_block(calls, dialect)
    )


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize(("model", "dialect"), [(V41, V41_DSML), (V4, V4_DSML)])
def test_replies_are_read_as_the_library_reads_them(model: str, dialect: Dialect, thinking):
    text = completion(dialect, thinking)
    ours = parse_completion(text, thinking, dialect=dialect)
    calls = [(c.name, json.loads(c.arguments)) for c in ours.tool_calls]
    assert (ours.reasoning_content, ours.content, calls) == library_reply(model, text, thinking)
    assert calls and all(c.complete for c in ours.tool_calls)
