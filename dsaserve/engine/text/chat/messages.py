"""OpenAI chat messages as DeepSeek's encoders read them (encoding_dsv4, encoding_dsv32), without
torch: each message checked and turned into a turn (system and developer -> System, user -> User,
assistant -> Assistant with its reasoning and calls, tool -> ToolResult, the V4 release's
`latest_reminder` -> Reminder), the request's tools into their `function` objects. What a format
makes of them is its encoder's business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# OpenAI's roles, and the V4 release's `latest_reminder` (a reminder the model reads late in the
# conversation, where it weighs most).
_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


class ChatEncodingError(ValueError):
    """A request a DeepSeek chat format cannot express; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class System:
    text: str
    tools: list[Mapping[str, Any]] = field(default_factory=list)  # each tool's `function`


@dataclass
class ToolResult:
    call_id: str
    text: str


@dataclass
class User:
    parts: list[str | ToolResult]


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass
class Assistant:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]


@dataclass
class Reminder:
    text: str


Turn = System | User | Assistant | Reminder  # (V4 folds tool results into user turns)


def read_messages(messages: Sequence[Mapping[str, Any]]) -> list[Turn | ToolResult]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatEncodingError("messages", "must be a non-empty list of messages")
    return [_read_message(f"messages[{i}]", message) for i, message in enumerate(messages)]


def _read_message(where: str, message: Mapping[str, Any]) -> Turn | ToolResult:
    if not isinstance(message, Mapping):
        raise ChatEncodingError(where, f"must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise ChatEncodingError(
            f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}"
        )
    content = message.get("content")
    if role in ("system", "developer"):
        return System(_text(f"{where}.content", content, "\n"))
    if role == "user":
        return User([_text(f"{where}.content", content, "\n")])
    if role == "latest_reminder":
        return Reminder(_text(f"{where}.content", content, "\n"))
    if role == "tool":
        call_id = message.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise ChatEncodingError(f"{where}.tool_call_id", "must be a string")
        # The release joins a tool result's text parts with a blank line.
        return ToolResult(call_id, _text(f"{where}.content", content, "\n\n"))
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")  # vLLM's name for the same field
    calls = message.get("tool_calls") or []
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ChatEncodingError(f"{where}.tool_calls", "must be a list")
    return Assistant(
        content=_text(f"{where}.content", content, "\n"),
        reasoning=_text(f"{where}.reasoning_content", reasoning, "\n"),
        tool_calls=[_read_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)],
    )


def _text(where: str, content: Any, joiner: str) -> str:
    """A message's text: a string, null (empty), or a list of {"type": "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatEncodingError(
            where, f"must be a string or a list of text parts, not {content!r:.60}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ChatEncodingError(
                f"{where}[{j}]", f"only text parts are supported, got {part!r:.60}"
            )
        if not isinstance(part.get("text"), str):
            raise ChatEncodingError(f"{where}[{j}].text", "must be a string")
        texts.append(part["text"])
    return joiner.join(texts)


def _read_tool_call(where: str, call: Any) -> ToolCall:
    if not isinstance(call, Mapping):
        raise ChatEncodingError(where, "must be an object")
    if call.get("type", "function") != "function":
        raise ChatEncodingError(f"{where}.type", f"must be 'function', got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatEncodingError(f"{where}.function", "must be an object with a string 'name'")
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise ChatEncodingError(f"{where}.id", "must be a string")
    raw = function.get("arguments")
    if isinstance(raw, str):
        try:
            arguments = json.loads(raw)
        except json.JSONDecodeError:
            # The release's own fallback: unparsable arguments become one string parameter.
            arguments = {"arguments": raw}
    else:
        arguments = raw  # vLLM also takes an already-parsed object
    if not isinstance(arguments, Mapping):
        raise ChatEncodingError(
            f"{where}.function.arguments", "must be a JSON object (each key becomes a parameter)"
        )
    return ToolCall(call_id, function["name"], arguments)


def read_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """Each tool's `function` object, the only part the release renders."""
    if tools is None:
        return []
    if isinstance(tools, str) or not isinstance(tools, Sequence):
        raise ChatEncodingError("tools", "must be a list of tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ChatEncodingError(
                f"tools[{i}]", 'must be {"type": "function", "function": {...}}'
            )
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatEncodingError(
                f"tools[{i}].function", "must be an object with a string 'name'"
            )
        functions.append(function)
    return functions
