"""engine.text.chat.encoding_dsv32: V3.2 prompts, compared with strings written out by hand, and
V3.2 replies (DSML `function_calls` blocks) read back.

Each expected prompt below was derived by reading the release's `encoding/encoding_dsv32.py`
(and checked against its gold test_output.txt while writing the encoder), not by running this
code; the comment on each case says which of its rules the case pins down. The conversations are
our own, in the shapes of the release's gold test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.engine.text.chat import (
    V32_DSML,
    ChatEncodingError,
    encode_messages_dsv32,
    parse_completion,
)
from dsaserve.engine.text.chat_format import ChatOptions, V32Chat, chat_format
from dsaserve.engine.text.tokenizer import Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
D = "｜DSML｜"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "convert", "description": "Währung umrechnen"},
    },
]

# The release's tools section for TOOLS, written out in full.
TOOLS_SECTION = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as \
part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while \
lists and objects should use JSON format. The "string" attribute should be set to "true" for \
string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider \
outputting a thinking block. Here is an example:

<｜DSML｜function_calls>
...
</｜DSML｜function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
{"name": "get_time", "description": "Current time in a city", "parameters": {"type": "object", \
"properties": {"city": {"type": "string"}}}}
{"name": "convert", "description": "Währung umrechnen"}
</functions>
"""

CALLS = [
    {
        "id": "a",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
    },
    {
        "id": "b",
        "type": "function",
        "function": {"name": "convert", "arguments": '{"amount": 5, "to": "NOK", "exact": true}'},
    },
]
BLOCK = (
    f"\n\n<{D}function_calls>\n"
    f'<{D}invoke name="get_time">\n'
    f'<{D}parameter name="city" string="true">Oslo</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="convert">\n'
    f'<{D}parameter name="amount" string="false">5</{D}parameter>\n'
    f'<{D}parameter name="to" string="true">NOK</{D}parameter>\n'
    f'<{D}parameter name="exact" string="false">true</{D}parameter>\n'
    f"</{D}invoke>\n"
    f"</{D}function_calls>"
)


def test_plain_multi_turn_chat() -> None:
    # Rules: BOS, the system text bare; every user turn is <｜User｜>text<｜Assistant｜> and, in
    # chat mode, </think>; an assistant turn is its content then EOS, its reasoning never shown.
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "reasoning_content": "Seven.", "content": "Seven."},
        {"role": "user", "content": "An even one?"},
    ]
    assert encode_messages_dsv32(messages, thinking=False) == (
        f"{BOS}Answer briefly.{USER}Name a prime.{ASSISTANT}</think>Seven.{EOS}"
        f"{USER}An even one?{ASSISTANT}</think>"
    )


def test_thinking_opens_only_the_last_user_turn_and_drops_earlier_reasoning() -> None:
    # Rules: only the last user turn opens <think>; an assistant turn before it renders without
    # its reasoning (and without </think>: its user turn closed thinking already).
    messages = [
        {"role": "user", "content": "6 times 7?"},
        {"role": "assistant", "reasoning_content": "6*7 = 42.", "content": "42."},
        {"role": "user", "content": "Halve it."},
        {"role": "user", "content": "Please."},
    ]
    assert encode_messages_dsv32(messages, thinking=True) == (
        f"{BOS}{USER}6 times 7?{ASSISTANT}</think>42.{EOS}"
        f"{USER}Halve it.{ASSISTANT}</think>{USER}Please.{ASSISTANT}<think>"
    )


def test_a_tool_loop_of_the_current_question_keeps_its_reasoning() -> None:
    # Rules: tools follow the system text after a blank line; after the last user turn the
    # assistant's reasoning is kept and closed by </think>, its calls a blank line and a
    # function_calls block (strings as they are, the rest as JSON); the results follow its EOS in
    # message order, <function_results> opened by a blank line, each <result> on a new line,
    # closed, a blank line and <think> (thinking, after the last user turn).
    messages = [
        {"role": "developer", "content": "Be precise."},
        {"role": "user", "content": "Time in Oslo, and 5 EUR in NOK?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two tools.",
            "tool_calls": CALLS,
        },
        {"role": "tool", "tool_call_id": "b", "content": "58.1"},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "14:05"}]},
    ]
    results = "\n\n<function_results>\n<result>58.1</result>\n<result>14:05</result>\n"
    assert encode_messages_dsv32(messages, thinking=True, tools=TOOLS) == (
        f"{BOS}Be precise.\n\n{TOOLS_SECTION}{USER}Time in Oslo, and 5 EUR in NOK?{ASSISTANT}"
        f"<think>Two tools.</think>{BLOCK}{EOS}{results}</function_results>\n\n<think>"
    )
    # chat mode: no reasoning, and the results close with </think>
    assert encode_messages_dsv32(messages, thinking=False, tools=TOOLS) == (
        f"{BOS}Be precise.\n\n{TOOLS_SECTION}{USER}Time in Oslo, and 5 EUR in NOK?{ASSISTANT}"
        f"</think>{BLOCK}{EOS}{results}</function_results>\n\n</think>"
    )


def test_an_earlier_tool_loop_renders_as_chat() -> None:
    # Rules: results before the last user turn close with </think> even in thinking mode; the
    # answer after them (before the last user turn) shows no reasoning; tools without a system
    # message go on an empty one in front.
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "reasoning_content": "Ask.", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "a", "content": "14:05"},
        {"role": "assistant", "reasoning_content": "Got it.", "content": "14:05."},
        {"role": "user", "content": "Thanks!"},
    ]
    call = BLOCK.split(f'\n<{D}invoke name="convert">')[0] + f"\n</{D}function_calls>"
    assert encode_messages_dsv32(messages, thinking=True, tools=TOOLS[:1]) == (
        f"{BOS}\n\n{TOOLS_SECTION.replace(TOOLS_SECTION.splitlines()[-2] + chr(10), '')}"
        f"{USER}Time?{ASSISTANT}</think>{call}{EOS}"
        "\n\n<function_results>\n<result>14:05</result>\n</function_results>\n\n</think>"
        f"14:05.{EOS}{USER}Thanks!{ASSISTANT}<think>"
    )


@pytest.mark.parametrize(
    "messages, where, message",
    [
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "messages[1]",
         "must end with a user or tool message"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "messages[1]",
         "must answer a tool call"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": CALLS},
          {"role": "tool", "content": "r"}, {"role": "user", "content": "y"}], "messages[3]",
         "made 2 tool calls but 1 tool messages answer them"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": CALLS[:1]},
          {"role": "tool", "content": "r"}, {"role": "tool", "content": "s"}], "messages[3]",
         "must answer a tool call"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]",
         "only text parts"),
    ],
)  # fmt: skip
def test_conversations_the_format_cannot_express_name_the_field(messages, where, message) -> None:
    with pytest.raises(ChatEncodingError, match=message) as err:
        encode_messages_dsv32(messages, thinking=False)
    assert err.value.param == where


def test_replies_with_function_calls_read_back_into_openai_fields() -> None:
    """What the model writes after a V3.2 prompt (the release's parse_message_from_completion_
    text's grammar): reasoning, content, a function_calls block."""
    reply = f"Two tools.</think>Checking.{BLOCK}{EOS}"
    message = parse_completion(reply, thinking=True, dialect=V32_DSML)
    assert (message.reasoning_content, message.content) == ("Two tools.", "Checking.")
    assert [(c.name, c.arguments, c.complete) for c in message.tool_calls] == [
        ("get_time", '{"city": "Oslo"}', True),
        ("convert", '{"amount": 5, "to": "NOK", "exact": true}', True),
    ]
    assert message.complete and not message.malformed
    # V4's grammar never sees the V3.2 block close: the reply would end inside a tool block
    v4 = parse_completion(reply, thinking=True)
    assert v4.tool_block_open and v4.malformed


def test_a_v32_checkpoint_without_a_template_gets_the_release_encoder(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, release=True)
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v32"}')
    fmt = chat_format(tmp_path, Tokenizer.from_pretrained(tmp_path))
    assert isinstance(fmt, V32Chat) and fmt.dialect == V32_DSML and fmt.renders_tools
    messages = [{"role": "user", "content": "Hi"}]
    assert fmt.render(messages, options=ChatOptions(thinking=True, reasoning_effort="max")) == (
        f"{BOS}{USER}Hi{ASSISTANT}<think>"  # one thinking level: no effort paragraph
    )
    with pytest.raises(ChatEncodingError, match="drop_thinking: is not an option"):
        fmt.render(messages, options=ChatOptions(variables={"drop_thinking": False}))
    with pytest.raises(ChatEncodingError, match="add_generation_prompt"):
        fmt.render(messages, add_generation_prompt=False)
    # a template of the checkpoint's own wins, and its replies are still read as V3.2's
    write_byte_tokenizer(tmp_path)
    fmt = chat_format(tmp_path, Tokenizer.from_pretrained(tmp_path))
    assert fmt.name == "the chat template" and fmt.dialect == V32_DSML
