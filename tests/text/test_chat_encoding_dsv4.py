"""engine.text.chat.encoding_dsv4: V4 prompts, compared with strings written out by hand.

Each expected prompt below was derived by reading the release's `encoding/encoding_dsv4.py`, not
by running this code; the comment on each case says which of its rules the case pins down. The
conversations are our own, in the shapes of the release's gold tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsaserve.engine.text.chat import ChatEncodingError, encode_messages
from tests import REPO_ROOT

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Währung umrechnen",
            "parameters": {
                "type": "object",
                "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
            },
        },
    },
]

# The release's tools section for TOOLS, written out in full.
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning \
inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_time", "description": "Current time in a city", "parameters": {"type": "object", \
"properties": {"city": {"type": "string"}}, "required": ["city"]}}
{"name": "convert", "description": "Währung umrechnen", "parameters": {"type": "object", \
"properties": {"amount": {"type": "number"}, "to": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)


def test_gold_plain_multi_turn_chat() -> None:
    # Rules: BOS, then the system text bare (no role token, no separator); each user turn is
    # <｜User｜>text and, since the assistant speaks next, <｜Assistant｜></think> in chat mode;
    # an assistant turn is its content then EOS. Chat mode never renders reasoning.
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {
            "role": "assistant",
            "reasoning_content": "Seven is the first that comes to mind.",
            "content": "Seven is prime.",
        },
        {"role": "user", "content": "And an even one?"},
    ]
    assert encode_messages(messages, thinking=False) == (
        f"{BOS}You answer in one short sentence."
        f"{USER}Name a prime number.{ASSISTANT}</think>Seven is prime.{EOS}"
        f"{USER}And an even one?{ASSISTANT}</think>"
    )


def test_gold_thinking_drops_earlier_reasoning() -> None:
    # Rules: in thinking mode only turns after the last user turn keep reasoning; an earlier
    # exchange renders as a chat one (its user turn closed with </think>, the reasoning gone
    # without a trace), and only the last user turn opens <think>. drop_thinking=False keeps
    # every turn's reasoning, each user turn then opening <think> and the reasoning closed by
    # </think> before the content.
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "reasoning_content": "6*7 = 42.", "content": "42."},
        {"role": "user", "content": "Now halve it."},
    ]
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}{USER}What is 6 times 7?{ASSISTANT}</think>42.{EOS}"
        f"{USER}Now halve it.{ASSISTANT}<think>"
    )
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        f"{BOS}{USER}What is 6 times 7?{ASSISTANT}<think>6*7 = 42.</think>42.{EOS}"
        f"{USER}Now halve it.{ASSISTANT}<think>"
    )


def test_gold_tool_call_and_results_merged_into_the_user_turn() -> None:
    # Rules: the tools section follows the system text after a blank line (the release's gold
    # test puts tools on the existing system message); with tools present no reasoning is
    # dropped, so the first user turn opens <think> too; the assistant's calls follow its
    # (empty) content as a blank line and a DSML block, strings with string="true", the number
    # as JSON with string="false"; the two tool messages become one user turn of <tool_result>
    # parts joined by a blank line, sorted back into call order (they arrive reversed).
    messages = [
        {"role": "system", "content": "Be precise."},
        {"role": "user", "content": "Time in Oslo, and 5 EUR in NOK?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two tools needed.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "convert", "arguments": '{"amount": 5, "to": "NOK"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "58.1"},
        {"role": "tool", "tool_call_id": "call_a", "content": "14:05"},
    ]
    assert encode_messages(messages, thinking=True, tools=TOOLS) == (
        f"{BOS}Be precise.\n\n{TOOLS_SECTION}"
        f"{USER}Time in Oslo, and 5 EUR in NOK?{ASSISTANT}<think>Two tools needed.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_time">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="convert">\n'
        '<｜DSML｜parameter name="amount" string="false">5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="to" string="true">NOK</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        f"{USER}<tool_result>14:05</tool_result>\n\n<tool_result>58.1</tool_result>"
        f"{ASSISTANT}<think>"
    )


def test_gold_reasoning_effort_max() -> None:
    # Rules: "max" in thinking mode puts the fixed effort paragraph right after BOS, before the
    # system text; "high" adds nothing, and in chat mode neither does "max".
    messages = [
        {"role": "system", "content": "Think hard."},
        {"role": "user", "content": "Is 91 prime?"},
    ]
    assert encode_messages(messages, thinking=True, reasoning_effort="max") == (
        f"{BOS}{EFFORT_MAX}Think hard.{USER}Is 91 prime?{ASSISTANT}<think>"
    )
    plain = f"{BOS}Think hard.{USER}Is 91 prime?{ASSISTANT}"
    assert encode_messages(messages, thinking=True, reasoning_effort="high") == plain + "<think>"
    assert encode_messages(messages, thinking=False, reasoning_effort="max") == plain + "</think>"


def test_gold_latest_reminder() -> None:
    # Rules: `<｜latest_reminder｜>` + text; a user turn followed by a reminder still opens the
    # reply first, so a trailing reminder is read inside the opened reasoning (thinking) or after
    # `</think>` (chat); earlier reminders stay when earlier reasoning is dropped.
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "latest_reminder", "content": "Be terse."},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye"},
        {"role": "latest_reminder", "content": "Today is Friday."},
    ]
    reminder = "<｜latest_reminder｜>"
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}{USER}Hi{ASSISTANT}</think>{reminder}Be terse.Hello.{EOS}"
        f"{USER}Bye{ASSISTANT}<think>{reminder}Today is Friday."
    )
    assert encode_messages(messages[:2], thinking=False) == (
        f"{BOS}{USER}Hi{ASSISTANT}</think>{reminder}Be terse."
    )


def test_tools_without_a_system_message_get_an_empty_one() -> None:
    # An empty system message's text is "", so the prompt opens with the blank line.
    prompt = encode_messages([{"role": "user", "content": "hi"}], thinking=False, tools=TOOLS)
    assert prompt == f"{BOS}\n\n{TOOLS_SECTION}{USER}hi{ASSISTANT}</think>"
    # An empty tools list is no tools.
    assert encode_messages([{"role": "user", "content": "hi"}], thinking=False, tools=[]) == (
        f"{BOS}{USER}hi{ASSISTANT}</think>"
    )


def test_developer_is_rendered_as_system_and_user_messages_merge() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    # Text parts join with "\n"; consecutive user messages are one turn, joined by a blank line.
    assert encode_messages(messages, thinking=True, add_default_bos_token=False) == (
        f"Rules.{USER}a\nb\n\nc{ASSISTANT}<think>"
    )


def _call(name: str, arguments: object) -> dict:
    return {"function": {"name": name, "arguments": arguments}}


def test_tool_arguments_forms() -> None:
    def rendered(arguments: object) -> str:
        results = [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]
        messages = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [_call("f", arguments)]},
            {"role": "tool", "content": results},
        ]
        prompt = encode_messages(messages, thinking=False)
        return prompt[prompt.index("</think>") + len("</think>") :]

    invoke = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n{}\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    tail = f"{EOS}{USER}<tool_result>r1\n\nr2</tool_result>{ASSISTANT}</think>"
    # Non-strings are JSON with the default separators and non-ASCII kept.
    args = {"q": "ü", "xs": [1, None, "二"], "o": {"k": True}}
    params = (
        '<｜DSML｜parameter name="q" string="true">ü</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="xs" string="false">[1, null, "二"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="o" string="false">{"k": true}</｜DSML｜parameter>'
    )
    assert rendered(json.dumps(args)) == invoke.format(params) + tail
    # Arguments that are not JSON become one string parameter, as the release does.
    fallback = '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>'
    assert rendered("not json") == invoke.format(fallback) + tail
    # No arguments: an empty line inside the invoke.
    assert rendered("{}") == invoke.format("") + tail


@pytest.mark.parametrize(
    "messages,kwargs,param",
    [
        ([{"role": "user", "content": "hi"}], {"reasoning_effort": "low"}, "reasoning_effort"),
        ([], {}, "messages"),
        ([{"role": "robot", "content": "hi"}], {}, "messages[0].role"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            {},
            "messages[1]",
        ),
        ([{"role": "system", "content": "s"}], {}, "messages[0]"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "messages[0].content[0]",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "tool_calls": [_call("f", "[1]")]},
                {"role": "tool", "content": "r"},
            ],
            {},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"role": "user", "content": "a"}], {"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "latest_reminder", "content": "c"},
            ],
            {},
            "messages[2]",
        ),
    ],
)
def test_inputs_the_format_cannot_express(messages: list, kwargs: dict, param: str) -> None:
    with pytest.raises(ChatEncodingError) as raised:
        encode_messages(messages, thinking=True, **kwargs)
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)  # the router maps ValueError to a 400


def test_package_does_not_import_torch() -> None:
    # The router imports this package and must start without torch.
    code = (
        "import sys, dsaserve.engine.text.chat; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)
