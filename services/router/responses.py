"""OpenAI response objects for one generation: whole answers and streaming chunks.

Chat and text completions differ only in object names and in how a choice carries text
(`message`/`delta` vs `text`); `ChatShape` and `TextShape` say just that. Every chunk of a
stream shares `id`, `created` and `model`.
"""

from __future__ import annotations

import time
from typing import Any

from .pd import Finish

JSON = dict[str, Any]


def usage_body(finish: Finish) -> JSON:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


class Shape:
    object: str
    chunk_object: str

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    # -- what differs between chat and text
    def _answer_choice(self, text: str) -> JSON:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None) -> JSON:
        """A streamed choice's text part; None for the finish chunk."""
        raise NotImplementedError

    def opening_chunks(self) -> list[JSON]:
        return []

    # -- shared envelopes
    def answer(self, text: str, finish: Finish) -> JSON:
        choice = {
            "index": 0,
            **self._answer_choice(text),
            "logprobs": None,
            "finish_reason": finish.reason,
        }
        return {**self._head(self.object), "choices": [choice], "usage": usage_body(finish)}

    def text_chunk(self, text: str) -> JSON:
        return self._chunk(self._chunk_choice(text), None)

    def finish_chunk(self, finish: Finish) -> JSON:
        return self._chunk(self._chunk_choice(None), finish.reason)

    def usage_chunk(self, finish: Finish) -> JSON:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_body(finish)}

    def _chunk(self, body: JSON, finish_reason: str | None) -> JSON:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(self.chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk but the last carries usage: null
        return chunk

    def _head(self, obj: str) -> JSON:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _answer_choice(self, text: str) -> JSON:
        return {"message": {"role": "assistant", "content": text}}

    def _chunk_choice(self, text: str | None) -> JSON:
        return {"delta": {} if text is None else {"content": text}}

    def opening_chunks(self) -> list[JSON]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, None)]


class TextShape(Shape):
    object = "text_completion"
    chunk_object = "text_completion"

    def _answer_choice(self, text: str) -> JSON:
        return {"text": text}

    def _chunk_choice(self, text: str | None) -> JSON:
        return {"text": text or ""}
