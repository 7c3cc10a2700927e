"""DeepSeek-V4.1 prompts, rendered by DeepSeek's own prompt library `deepseek-recipe` (PyPI, MIT;
Rust with Python bindings), as vLLM renders gpt-oss with `openai-harmony`: the model's authors
keep the format.

The library is V4.1's format: `<｜System｜>` opening the system turn, the reasoning effort
written into the first system turn as a number (its levels low, high, xhigh and max are 50, 75,
75 and 100; thinking without a level is 75), spaced DSML tags (`<｜DSML｜ calls>`; `dsml`'s
V41_DSML reads them back). There is no encoder of our own for it: a chat goes to the library as
the Chat Completions body it is (`ChatCompletionRequest`, the library's conversion, so its
checks are V4.1's), with only what shapes the prompt (messages, tools, thinking, effort); what
the router serves beyond the library (n, logprobs, constrained decoding, ...) stays out of it.

DeepSeek-V4 keeps its release encoder (`encoding_dsv4`): the library's V4 encoding is the
format DeepSeek's API serves V4-Pro in, which is not the open release's (it writes a
`latest_reminder` before the assistant's opening, joins system turns with a blank line,
re-serializes tools as {name, description, parameters}, and writes a call without arguments
on one line). Rendering
V4 with it would change our V4 prompts; tests/text/test_chat_recipe.py pins where the two agree
and each place they part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import deepseek_recipe as recipe

from dsaserve.engine.text.chat.messages import (
    ChatEncodingError,
    check_answerable,
    read_messages,
    read_tools,
)

V41_MODEL = "DeepSeek-V4.1-Flash"  # the library's name of the model (its model version)
# OpenAI's reasoning efforts (less "none", which turns thinking off) -> the library's V4.1
# levels; "minimal" and "medium", which DeepSeek's API does not name, go to the level at or
# above them.
V41_EFFORTS: Mapping[str, str] = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}


def render_v41(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    reasoning_effort: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> str:
    """The DeepSeek-V4.1 prompt of an OpenAI chat. reasoning_effort: OpenAI's level (None: the
    library's default in thinking mode). Raises ChatEncodingError for a chat it cannot render."""
    check_answerable(read_messages(messages))  # our checks first: their errors name the field
    read_tools(tools)
    body: dict[str, Any] = {
        "model": V41_MODEL,
        # OpenAI's `developer` role (system, for its reasoning models) is one the library does
        # not name: a system turn, as the V4 encoder renders it
        "messages": [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if thinking and reasoning_effort is not None:
        body["reasoning_effort"] = V41_EFFORTS[reasoning_effort]
    if tools:
        body["tools"] = list(tools)
    try:
        request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
        return recipe.DeepseekV41Encoding().render_conversation(request.conversation).prompt
    except (recipe.ConversionError, ValueError) as e:
        raise ChatEncodingError("messages", f"DeepSeek-V4.1's format refuses it: {e}") from None
