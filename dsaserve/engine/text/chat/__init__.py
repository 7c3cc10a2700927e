"""DeepSeek's chat formats, without torch: prompts from OpenAI messages, and the model's output
(reasoning, content, DSML tool calls) back into OpenAI fields, whole or streamed.

`encoding_dsv4` and `encoding_dsv32` write prompts the way the V4 and V3.2 releases'
`encoding/encoding_dsv*.py` do, from the turns `messages` reads; `dsml` writes and reads tool
calls (a `Dialect` a family) and reads completions; `tokens` names the special-token strings.
"""

from __future__ import annotations

from dsaserve.engine.text.chat.dsml import (
    V4_DSML,
    V32_DSML,
    ContentDelta,
    Dialect,
    Event,
    ParsedMessage,
    ReasoningDelta,
    StreamParser,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    parse_completion,
)
from dsaserve.engine.text.chat.encoding_dsv4 import encode_messages
from dsaserve.engine.text.chat.encoding_dsv32 import encode_messages_dsv32
from dsaserve.engine.text.chat.messages import ChatEncodingError

__all__ = [
    "ChatEncodingError",
    "V4_DSML",
    "V32_DSML",
    "ContentDelta",
    "Dialect",
    "Event",
    "ParsedMessage",
    "ReasoningDelta",
    "StreamParser",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "encode_messages",
    "encode_messages_dsv32",
    "parse_completion",
]
