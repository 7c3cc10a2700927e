"""DeepSeek-V3.2 prompts from OpenAI chat requests, exactly as the release's encoder writes them.

The V3.2 release ships no Jinja template; its `encoding/encoding_dsv32.py` is the format's
definition, and `encode_messages_dsv32` returns what that encoder returns for the same
conversation (thinking_mode "thinking"/"chat" <-> `thinking`). What the release does, in brief:

- The prompt is BOS, then each message in turn, with no separators. A system message is its bare
  text, followed (when the request has tools) by a blank line and the "## Tools" section: each
  tool's `function` object as `json.dumps` (default separators, non-ASCII kept), one a line,
  inside `<functions>` ... `</functions>`.
- A user turn is `<｜User｜>` + text + `<｜Assistant｜>`, then `<think>` if it is the last user
  turn and the request thinks, else `</think>`: every user turn opens an answer, thinking or not.
- An assistant turn is [reasoning + `</think>`] + content + [tool calls] + EOS, where the
  reasoning part exists only in thinking mode and only after the last user turn (the tool loop
  of the current question); earlier turns' reasoning is dropped without a trace.
- Tool calls are a blank line and a DSML block named `function_calls` (dsml.V32_DSML,
  dsml.tool_calls_block): string arguments as they are with string="true", the rest as JSON.
- Tool results follow their assistant turn, in message order: `\\n\\n<function_results>`, then
  `\\n<result>...</result>` for each, then `\\n</function_results>\\n\\n` and `<think>` (thinking,
  after the last user turn) or `</think>`: the model answers the results.
- There is no reasoning-effort paragraph: V3.2 has one thinking level.

Where the OpenAI API and the release differ, we chose as for V4 (encoding_dsv4): top-level
`tools` go on the first message when it is a system message, else on a new empty system message
in front; OpenAI's `developer` role is a system message (the release's own `developer` role is
an internal search-agent format); text content parts are joined with "\\n" ("\\n\\n" in tool
results). The release asserts on a tool message that does not answer a call of the assistant
turn before it; here every call needs exactly one result before the conversation goes on (as
OpenAI requires), and the conversation must end with a user or tool message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dsaserve.engine.text.chat.dsml import V32_DSML, tool_calls_block
from dsaserve.engine.text.chat.messages import (
    Assistant,
    ChatEncodingError,
    Reminder,
    System,
    ToolResult,
    User,
    read_messages,
    read_tools,
)
from dsaserve.engine.text.chat.tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    FUNCTION_RESULTS_CLOSE,
    FUNCTION_RESULTS_OPEN,
    RESULT_CLOSE,
    RESULT_OPEN,
    THINK_END,
    THINK_START,
    USER,
)

_TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    f"<{DSML}function_calls>\n"
    f'<{DSML}invoke name="$FUNCTION_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}function_calls>\n\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    'while lists and objects should use JSON format. The "string" attribute should be set to '
    '"true" for string type parameters and "false" for other types (numbers, booleans, arrays, '
    "objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider "
    "outputting a thinking block. Here is an example:\n\n"
    f"<{DSML}function_calls>\n"
    "...\n"
    f"</{DSML}function_calls>\n\n"
    f"{FUNCTION_RESULTS_OPEN}\n"
    "...\n"
    f"{FUNCTION_RESULTS_CLOSE}\n\n"
    f"{THINK_START}...thinking about results{THINK_END}\n\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    "{schemas}\n"
    "</functions>\n"
)


def encode_messages_dsv32(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_default_bos_token: bool = True,
) -> str:
    """The V3.2 prompt for an OpenAI-shaped conversation, ending where the model starts to answer.

    `messages` are OpenAI chat messages (roles system, developer, user, assistant, tool;
    assistant `tool_calls` with `function.arguments` as a JSON string; `reasoning_content`, or
    vLLM's `reasoning`, on assistant messages). `tools` is the request's OpenAI `tools` list.
    Raises ChatEncodingError for input the format cannot express.
    """
    turns = read_messages(messages)
    for i, turn in enumerate(turns):
        if isinstance(turn, Reminder):  # (V4's role: V3.2's tokenizer has no marker for it)
            raise ChatEncodingError(
                f"messages[{i}].role", "latest_reminder is DeepSeek-V4's role; V3.2 has none"
            )
    functions = read_tools(tools)
    if functions:
        if isinstance(turns[0], System):
            turns[0].tools = functions
        else:
            turns.insert(0, System("", functions))
    if not isinstance(turns[-1], User | ToolResult):
        raise ChatEncodingError(
            f"messages[{len(messages) - 1}]",
            "the conversation must end with a user or tool message; this model is only asked "
            "to answer after one",
        )
    offset = len(turns) - len(messages)  # (1 when a system turn went in front)
    last_user = max((i for i, turn in enumerate(turns) if isinstance(turn, User)), default=-1)
    prompt = [BOS] if add_default_bos_token else []
    calls = 0  # tool calls of the latest assistant turn still to be answered
    answered = 0
    for i, turn in enumerate(turns):
        if calls and not isinstance(turn, ToolResult):
            raise _unanswered(i - offset, len(messages), calls, answered)
        if isinstance(turn, System):
            prompt.append(turn.text)
            if turn.tools:
                prompt.append("\n\n" + _tools_section(turn.tools))
        elif isinstance(turn, User):
            opens = THINK_START if thinking and i == last_user else THINK_END
            text = "".join(part for part in turn.parts if isinstance(part, str))
            prompt.append(USER + text + ASSISTANT + opens)
        elif isinstance(turn, Assistant):
            reasoning = turn.reasoning + THINK_END if thinking and i > last_user else ""
            block = tool_calls_block([(c.name, c.arguments) for c in turn.tool_calls], V32_DSML)
            prompt.append(reasoning + turn.content + block + EOS)
            calls, answered = len(turn.tool_calls), 0
        else:
            if not calls:
                raise ChatEncodingError(
                    f"messages[{i - offset}]",
                    "a tool message must answer a tool call of the assistant message before it",
                )
            opening = "\n\n" + FUNCTION_RESULTS_OPEN if answered == 0 else ""
            prompt.append(opening + "\n" + RESULT_OPEN + turn.text + RESULT_CLOSE)
            answered += 1
            if answered == calls:
                opens = THINK_START if thinking and i >= last_user else THINK_END
                prompt.append("\n" + FUNCTION_RESULTS_CLOSE + "\n\n" + opens)
                calls = 0
    if calls:
        raise _unanswered(len(messages), len(messages), calls, answered)
    return "".join(prompt)


def _tools_section(functions: list[Mapping[str, Any]]) -> str:
    schemas = "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)
    return _TOOLS_SECTION.replace("{schemas}", schemas)


def _unanswered(at: int, total: int, calls: int, answered: int) -> ChatEncodingError:
    """The assistant turn before messages[at] (at == total: the end) made `calls` tool calls,
    of which `answered` got a tool message."""
    where = f"messages[{at}]" if at < total else "messages"
    before = "before it" if at < total else "at the end"
    return ChatEncodingError(
        where,
        f"the assistant message {before} made {calls} tool calls but {answered} tool messages "
        "answer them; send one tool message for each tool call, right after it",
    )
