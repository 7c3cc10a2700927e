"""engine.text.chat.dsml: V4 completions into reasoning, content and tool calls, whole and streamed.

Expected values follow the release's `parse_message_from_completion_text` for well-formed output;
the recovery cases (no </think>, output cut inside a tool block) are ours, since the release
raises on them.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from dsaserve.engine.text.chat import (
    ContentDelta,
    Event,
    ParsedMessage,
    ReasoningDelta,
    StreamParser,
    ToolCallArguments,
    ToolCallStart,
    encode_messages,
    parse_completion,
)

EOS = "<｜end▁of▁sentence｜>"
D = "｜DSML｜"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    """A DSML invoke as the model writes it; params are (name, "true"|"false", value)."""
    lines = [f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>' for k, s, v in params]
    return f'<{D}invoke name="{name}">\n' + "\n".join(lines) + f"\n</{D}invoke>"


def block(*invokes: str) -> str:
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def counter_ids() -> object:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


# A thinking-mode output with everything: reasoning, content, then two calls, the first with a
# string, a JSON number and a multi-line string with quotes; the second with a JSON object.
SCRIPT = (
    "The user wants weather and a sum. Use both tools; 2 < 3 holds."
    "</think>"
    "Checking both now.\nOne moment."
    + block(
        invoke(
            "get_weather",
            ("city", "true", "São Paulo"),
            ("days", "false", "3"),
            ("note", "true", 'say "hi"\nthen \\ bye'),
        ),
        invoke("add", ("terms", "false", '{"a": [1, 2.5], "b": null}')),
    )
    + EOS
)
SCRIPT_REASONING = "The user wants weather and a sum. Use both tools; 2 < 3 holds."
SCRIPT_CONTENT = "Checking both now.\nOne moment."
SCRIPT_CALLS = [
    (
        "get_weather",
        '{"city": "São Paulo", "days": 3, "note": "say \\"hi\\"\\nthen \\\\ bye"}',
    ),
    ("add", '{"terms": {"a": [1, 2.5], "b": null}}'),
]


def calls(message: ParsedMessage) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in message.tool_calls]


# --- whole outputs -------------------------------------------------------------------------------


def test_parse_thinking_output_with_two_tool_calls() -> None:
    message = parse_completion(SCRIPT, thinking=True)
    assert message.reasoning_content == SCRIPT_REASONING
    assert message.content == SCRIPT_CONTENT  # the blank line before the block is neither
    assert calls(message) == SCRIPT_CALLS
    assert json.loads(message.tool_calls[0].arguments)["note"] == 'say "hi"\nthen \\ bye'
    assert all(call.complete for call in message.tool_calls)
    assert message.complete and not message.malformed
    for call in message.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert len({call.id for call in message.tool_calls}) == 2


def test_parse_plain_outputs() -> None:
    # The engine stops at EOS and drops its text, so EOS is optional; anything after it is not
    # part of the message.
    for text in ("Paris.", f"Paris.{EOS}", f"Paris.{EOS}ignored"):
        message = parse_completion(text, thinking=False)
        assert (message.reasoning_content, message.content, message.tool_calls) == (
            "",
            "Paris.",
            (),
        )
        assert message.complete
    message = parse_completion("Easy.</think>\n\nParis.", thinking=True)
    assert (message.reasoning_content, message.content) == ("Easy.", "\n\nParis.")
    # A tool call with no parameters, and no content before the block.
    message = parse_completion(block(invoke("now")) + EOS, thinking=False)
    assert (message.content, calls(message)) == ("", [("now", "{}")])


def test_parse_what_the_encoder_renders() -> None:
    # The assistant turn the encoder writes into history parses back to the same call.
    arguments = {"path": "a/b.txt", "lines": [1, 2], "opts": {"force": True}, "mode": "w"}
    messages = [
        {"role": "user", "content": "write it"},
        {
            "role": "assistant",
            "reasoning_content": "Write the file.",
            "content": "Writing.",
            "tool_calls": [{"function": {"name": "write", "arguments": json.dumps(arguments)}}],
        },
        {"role": "tool", "content": "ok"},
    ]
    prompt = encode_messages(messages, thinking=True, drop_thinking=False)
    start = prompt.index("<think>") + len("<think>")
    turn = prompt[start : prompt.index(EOS, start) + len(EOS)]
    message = parse_completion(turn, thinking=True)
    assert (message.reasoning_content, message.content) == ("Write the file.", "Writing.")
    assert calls(message) == [("write", json.dumps(arguments))]


def test_tool_block_before_think_end_still_yields_the_calls() -> None:
    # Models sometimes go straight from reasoning to a call; the release raises, vLLM lost the
    # call. The block ends the reasoning.
    text = "I should look it up." + block(invoke("search", ("q", "true", "V4"))) + EOS
    message = parse_completion(text, thinking=True)
    assert message.reasoning_content == "I should look it up."
    assert (message.content, calls(message)) == ("", [("search", '{"q": "V4"}')])
    assert message.complete


def test_unterminated_think() -> None:
    message = parse_completion("Let me think about the primes below 1", thinking=True)
    assert message.reasoning_content == "Let me think about the primes below 1"
    assert (message.content, message.tool_calls) == ("", ())
    assert message.reasoning_open and not message.tool_block_open and not message.complete
    # A </think> cut off by the end of the output is dropped, not shown as reasoning.
    message = parse_completion("Almost done.</thi", thinking=True)
    assert message.reasoning_content == "Almost done." and message.reasoning_open


def test_unterminated_tool_block() -> None:
    # Cut by max_tokens inside the second call's string value: the first call is whole, the
    # second keeps what was written (its arguments are not valid JSON yet).
    text = "Two lookups." + block(
        invoke("a", ("x", "false", "12")), invoke("b", ("q", "true", "partial value"))
    )
    text = text[: text.index("value") + len("val")]
    message = parse_completion(text, thinking=False)
    assert message.content == "Two lookups."
    assert calls(message) == [("a", '{"x": 12}'), ("b", '{"q": "partial val')]
    assert [call.complete for call in message.tool_calls] == [True, False]
    assert message.tool_block_open and not message.reasoning_open and not message.complete
    # Cut inside the block's opening tag: no markup in the content, and the flag says why.
    message = parse_completion(f"Let me check.\n\n<{D}tool_ca", thinking=False)
    assert (message.content, message.tool_calls) == ("Let me check.", ())
    assert message.tool_block_open
    # Cut inside an invoke's header: no call was started.
    message = parse_completion(f'\n\n<{D}tool_calls>\n<{D}invoke name="ge', thinking=False)
    assert message.tool_calls == () and message.tool_block_open


def test_malformed_markup_is_repaired_and_flagged() -> None:
    text = (
        f"\n\n<{D}tool_calls>\nstray text\n"
        + invoke("f", ("n", "false", "not json"), ("s", "maybe", "7"))
        + f"\n</{D}tool_calls>\nAfterthought."
    )
    message = parse_completion(text, thinking=False)
    # A string="false" value that is not JSON becomes a JSON string, so arguments always parse;
    # a missing string flag keeps the value as JSON when it parses.
    assert calls(message) == [("f", '{"n": "not json", "s": 7}')]
    assert message.content == "Afterthought."  # text after the block is content again
    assert message.malformed and message.complete
    # Stray think tags never reach the content.
    message = parse_completion("<think>a</think>b", thinking=False)
    assert (message.content, message.malformed) == ("ab", False)


# --- streaming -----------------------------------------------------------------------------------


def run(pieces: list[str], thinking: bool = True) -> tuple[list[Event], ParsedMessage]:
    parser = StreamParser(thinking, new_id=counter_ids())
    events = [event for piece in pieces for event in parser.feed(piece)]
    events += parser.finish()
    return events, parser.message()


def merged(events: list[Event]) -> list[Event]:
    """Adjacent text deltas of one kind (and one call) joined: the stream's shape."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ReasoningDelta | ContentDelta) and type(last) is type(event):
            out[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        elif (
            isinstance(event, ToolCallArguments)
            and isinstance(last, ToolCallArguments)
            and last.index == event.index
        ):
            out[-1] = ToolCallArguments(event.index, last.fragment + event.fragment)
        else:
            out.append(event)
    return out


EXPECTED_STREAM = [
    ReasoningDelta(SCRIPT_REASONING),
    ContentDelta(SCRIPT_CONTENT),
    ToolCallStart(0, "call_0", "get_weather"),
    ToolCallArguments(0, SCRIPT_CALLS[0][1]),
    ToolCallStart(1, "call_1", "add"),
    ToolCallArguments(1, SCRIPT_CALLS[1][1]),
]


def splits() -> list[list[str]]:
    two_pieces = [[SCRIPT[:i], SCRIPT[i:]] for i in range(len(SCRIPT) + 1)]
    return [*two_pieces, list(SCRIPT)]


@pytest.mark.parametrize("pieces", splits(), ids=lambda p: f"{len(p)}:{len(p[0])}")
def test_stream_matches_the_whole_parse_however_split(pieces: list[str]) -> None:
    events, message = run(pieces)
    assert merged(events) == EXPECTED_STREAM
    whole = parse_completion(SCRIPT, thinking=True, new_id=counter_ids())
    assert message == whole
    for event in events:
        if isinstance(event, ReasoningDelta | ContentDelta):
            assert event.text, "empty delta"
            # No character of any marker's markup reaches the text channels.
            assert not set(event.text) & set("｜▁"), event
            assert "</think>" not in event.text and not event.text.endswith("\n\n")


def test_stream_events_come_as_soon_as_text_is_decided() -> None:
    parser = StreamParser(thinking=False, new_id=counter_ids())
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    # "<" and newlines could start a tool block: held until the next delta decides.
    assert parser.feed("ld\n") == [ContentDelta("ld")]
    assert parser.feed("\n<") == []
    assert parser.feed("b>") == [ContentDelta("\n\n<b>")]
    assert parser.feed(f'\n\n<{D}tool_calls>\n<{D}invoke name="f">') == [
        ToolCallStart(0, "call_0", "f")
    ]
    assert parser.feed(f'\n<{D}parameter name="q" string="true">ab') == [
        ToolCallArguments(0, '{"q": "'),
        ToolCallArguments(0, "ab"),
    ]
    assert parser.feed("c</") == [ToolCallArguments(0, "c")]
    assert parser.feed(f"{D}parameter>\n</{D}invoke>") == [
        ToolCallArguments(0, '"'),
        ToolCallArguments(0, "}"),
    ]
    assert parser.finish() == []
    assert parser.message().tool_block_open  # no </｜DSML｜tool_calls> came
    with pytest.raises(RuntimeError):
        parser.feed("more")
