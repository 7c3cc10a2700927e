"""DeepSeek-V4's chat format, without torch: prompts from OpenAI messages, and (later) the model's
output back into OpenAI fields.

`encoding_dsv4` writes prompts the way the release's `encoding/encoding_dsv4.py` does; `tokens`
names the special-token strings.
"""

from __future__ import annotations

from engine.chat.encoding_dsv4 import ChatEncodingError, encode_messages

__all__ = ["ChatEncodingError", "encode_messages"]
