"""DeepSeek-V4 prompts from OpenAI chat requests, exactly as the release's encoder writes them.

The V4 release ships no Jinja template; its `encoding/encoding_dsv4.py` is the format's
definition, and `encode_messages` here returns exactly what that encoder returns for the same
conversation (thinking_mode "thinking"/"chat" <-> `thinking`). What the release does, in brief:

- The prompt is BOS, then each message in turn, with no separators. A system message is its bare
  text; a user turn is `<｜User｜>` + text; an assistant turn is [reasoning + `</think>`] + content
  + [tool calls] + EOS.
- A user turn followed by nothing or by an assistant turn is followed by `<｜Assistant｜>` and then
  `<think>` (thinking) or `</think>` (chat). So a chat prompt ends `<｜Assistant｜></think>` and
  a thinking prompt `<｜Assistant｜><think>`.
- In thinking mode earlier turns are rendered as chat turns (their reasoning dropped, their user
  turn closed with `</think>`) -- unless tools are present anywhere, then every turn keeps its
  reasoning; `drop_thinking=False` keeps it too.
- There is no tool role: tool results join the user turn as `<tool_result>...</tool_result>`, in
  the order of the calls that asked for them; consecutive user/tool messages make one turn, their
  parts separated by a blank line.
- Tool schemas go in a "## Tools" section after the system text: only each tool's `function`
  object, `json.dumps` with default separators, non-ASCII kept, key order kept, one per line.
- Assistant tool calls render as a blank line and a DSML block (dsml.tool_calls_block).
  Arguments are parsed from their JSON string; string values go in as is with string="true",
  anything else as JSON with string="false".
- reasoning_effort "max" (thinking mode only) puts a fixed paragraph right after BOS; "high" and
  None add nothing.
- The release's `latest_reminder` role is `<｜latest_reminder｜>` + its text. A user turn followed
  by one still opens the assistant's reply first, so a reminder after the last user turn is the
  last thing the model reads before it answers (inside its opened reasoning in thinking mode).

Where the OpenAI API and the release differ, we chose:

- Top-level `tools` go on the first message when it is a system message -- what the release's own
  gold test does (`messages[0]["tools"] = tools`), so the section follows the system text after a
  blank line -- and otherwise on a new empty system message in front. vLLM always inserts an empty
  system message, which puts the tools section before the system text with nothing between them;
  the two differ only when the request has a leading system message.
- OpenAI's `developer` role (which replaced `system` for OpenAI's reasoning models) is rendered as
  a system message. The release's own `developer` role is an internal search-agent role that the
  release notes say the official API refuses; it renders as a user turn and, in thinking mode,
  is silently dropped from earlier turns, which would lose the client's instructions.
- Text content parts are joined with "\n" (as vLLM does, and engine.text.tokenizer), except in tool
  results, where the release itself joins text parts with a blank line.
- The conversation must end with a user or tool message, or with reminders after one: the release
  only prompts the model to answer after a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dsaserve.engine.text.chat.dsml import V4_DSML, tool_calls_block
from dsaserve.engine.text.chat.messages import (
    Assistant,
    ChatEncodingError,
    Reminder,
    System,
    ToolResult,
    Turn,
    User,
    read_messages,
    read_tools,
)
from dsaserve.engine.text.chat.tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    THINK_END,
    THINK_START,
    TOOL_RESULT_CLOSE,
    TOOL_RESULT_OPEN,
    USER,
)

REASONING_EFFORTS = (None, "high", "max")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is "
    "left unchecked.\n\n"
)

_TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_default_bos_token: bool = True,
    drop_thinking: bool = True,
) -> str:
    """The V4 prompt for an OpenAI-shaped conversation, ending where the model starts to answer.

    `messages` are OpenAI chat messages (roles system, developer, user, assistant, tool;
    assistant `tool_calls` with `function.arguments` as a JSON string; `reasoning_content`, or
    vLLM's `reasoning`, on assistant messages). `tools` is the request's OpenAI `tools` list.
    Raises ChatEncodingError for input the format cannot express.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatEncodingError(
            "reasoning_effort",
            f"must be one of 'high', 'max' or null for this model, got {reasoning_effort!r}",
        )
    turns = _merge_tool_results(read_messages(messages))
    functions = read_tools(tools)
    if functions:
        if isinstance(turns[0], System):
            turns[0].tools = functions
        else:
            turns.insert(0, System("", functions))
    answered = next((t for t in reversed(turns) if not isinstance(t, Reminder)), None)
    if not isinstance(answered, User):
        raise ChatEncodingError(
            f"messages[{len(messages) - 1}]",
            "the conversation must end with a user or tool message (or latest_reminder messages "
            "after one); this model is only asked to answer after one",
        )
    _sort_tool_results(turns)
    # With tools the release keeps every turn's reasoning: tool loops need it.
    drop = drop_thinking and not functions
    last_user = max(i for i, turn in enumerate(turns) if isinstance(turn, User))
    prompt = [BOS] if add_default_bos_token else []
    if thinking and reasoning_effort == "max":
        prompt.append(REASONING_EFFORT_MAX)
    for i, turn in enumerate(turns):
        if isinstance(turn, System):
            prompt.append(turn.text)
            if turn.tools:
                prompt.append("\n\n" + _tools_section(turn.tools))
        elif isinstance(turn, User):
            prompt.append(USER + "\n\n".join(map(_user_part, turn.parts)))
            # As the release: only a user turn that the assistant answers opens its reply.
            if i + 1 == len(turns) or isinstance(turns[i + 1], Assistant | Reminder):
                opens_thinking = thinking and (not drop or i >= last_user)
                prompt.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
        elif isinstance(turn, Reminder):
            prompt.append(LATEST_REMINDER + turn.text)
        else:
            # Dropped reasoning leaves no trace, not even `</think>`: the user turn before it
            # already closed thinking.
            keeps_reasoning = thinking and (not drop or i > last_user)
            reasoning = turn.reasoning + THINK_END if keeps_reasoning else ""
            calls = tool_calls_block([(c.name, c.arguments) for c in turn.tool_calls], V4_DSML)
            prompt.append(reasoning + turn.content + calls + EOS)
    return "".join(prompt)


def _user_part(part: str | ToolResult) -> str:
    if isinstance(part, ToolResult):
        return TOOL_RESULT_OPEN + part.text + TOOL_RESULT_CLOSE
    return part


def _tools_section(functions: list[Mapping[str, Any]]) -> str:
    schemas = "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)
    return _TOOLS_SECTION.replace("{schemas}", schemas)


def _merge_tool_results(turns: list[Turn | ToolResult]) -> list[Turn]:
    """Fold tool results and consecutive user messages into single user turns, as the release."""
    merged: list[Turn] = []
    for turn in turns:
        if isinstance(turn, User | ToolResult):
            parts = turn.parts if isinstance(turn, User) else [turn]
            if merged and isinstance(merged[-1], User):
                merged[-1].parts.extend(parts)
            else:
                merged.append(User(list(parts)))
        else:
            merged.append(turn)
    return merged


def _sort_tool_results(turns: list[Turn]) -> None:
    """Put each turn's tool results in the order of the latest assistant's tool calls.

    As the release: results whose id no call has sort as if answering the first call (a stable
    sort), and text parts keep their places.
    """
    order: dict[str, int] = {}
    for turn in turns:
        if isinstance(turn, Assistant) and turn.tool_calls:
            order = {call.call_id: i for i, call in enumerate(turn.tool_calls) if call.call_id}
        elif isinstance(turn, User) and order:
            slots = [i for i, part in enumerate(turn.parts) if isinstance(part, ToolResult)]
            results = [part for part in turn.parts if isinstance(part, ToolResult)]
            results.sort(key=lambda result: order.get(result.call_id, 0))
            for slot, result in zip(slots, results, strict=True):
                turn.parts[slot] = result
