"""DeepSeek-V4's chat format, without torch: prompts from OpenAI messages, and the model's output
(reasoning, content, DSML tool calls) back into OpenAI fields, whole or streamed.

`encoding_dsv4` writes prompts the way the release's `encoding/encoding_dsv4.py` does; `dsml`
reads completions; `tokens` names the special-token strings both use.
"""

from __future__ import annotations

from engine.text.chat.dsml import (
    ContentDelta,
    Event,
    ParsedMessage,
    ReasoningDelta,
    StreamParser,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    parse_completion,
)
from engine.text.chat.encoding_dsv4 import ChatEncodingError, encode_messages

__all__ = [
    "ChatEncodingError",
    "ContentDelta",
    "Event",
    "ParsedMessage",
    "ReasoningDelta",
    "StreamParser",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "encode_messages",
    "parse_completion",
]
