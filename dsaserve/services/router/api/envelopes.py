"""OpenAI response envelopes for one request: whole answers and streaming chunks.

Chat and text completions differ only in object names and in their choices (choices.py); every
chunk of a stream shares `id`, `created` and `model`. Usage counts the prompt once and the
completion tokens of every choice, (OpenAI's prompt_tokens_details.cached_tokens) the prompt
tokens the prefill worker resumed from its prefix cache, and for chats (completion_tokens_details.
reasoning_tokens) the completion tokens of the reasoning. With vLLM's
`stream_options.continuous_usage_stats` every chunk carries the usage so far (the tokens out
until then), not only the last one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

from dsaserve.services.router.choices import ChatChoice, Choice
from dsaserve.services.router.pd import Event, Finish

JSON = dict[str, Any]
# As Starlette's JSONResponse writes a body.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class Reply:
    """The answer to one request, fed its choices' events in any interleaving."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        choices: Sequence[Choice],
        prompt_tokens: int,
        continuous_usage: bool = False,
    ) -> None:
        chat = isinstance(choices[0], ChatChoice)
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.choices = list(choices)
        self.prompt_tokens = prompt_tokens
        self.continuous_usage = continuous_usage
        self._finishes: dict[int, Finish] = {}
        self._tokens_out = 0  # completion tokens so far, every choice's
        self._chunk_head = self._head(self.chunk_object)  # every chunk's first keys

    def opening_chunks(self) -> list[JSON]:
        """Chunks that open a stream (chat: each choice's role)."""
        return [self._chunk(o) for c in self.choices if (o := c.opening()) is not None]

    def chunks(self, index: int, event: Event) -> list[JSON]:
        """What choice `index`'s event adds to the stream; the last finish brings the usage."""
        choice = self.choices[index]
        if not isinstance(event, Finish):
            self._tokens_out += len(event.token_ids)
            body = choice.chunk(event)
            return [] if body is None else [self._chunk(body)]
        self._finishes[index] = event
        out = [self._chunk(choice.finish(event))]
        if self.include_usage and len(self._finishes) == len(self.choices):
            out.append({**self._head(self.chunk_object), "choices": [], "usage": self._usage()})
        return out

    def feed(self, index: int, event: Event) -> None:
        """Choice `index`'s event, for a whole answer: taken in, nothing rendered yet."""
        choice = self.choices[index]
        if isinstance(event, Finish):
            self._finishes[index] = event
            choice.finish(event)
        else:
            choice.record(event)

    def answer_parts(self) -> Iterator[bytes]:
        """The whole answer's JSON once every choice has finished, written a choice at a time:
        each is rendered, encoded and let go before the next (with its logprobs a choice may
        be megabytes; the answer, their sum)."""
        head = _ENCODER.encode(self._head(self.object))
        yield (head[:-1] + ',"choices":[').encode()
        for i, choice in enumerate(self.choices):
            yield ("," if i else "").encode() + _ENCODER.encode(choice.answer()).encode()
        tail = '],"usage":' + _ENCODER.encode(self._usage())
        first = self.choices[0]
        if isinstance(first, ChatChoice) and (scores := first.prompt_logprobs()) is not None:
            tail += ',"prompt_logprobs":' + _ENCODER.encode(scores)  # (vLLM: the chat's, once)
        yield (tail + "}").encode()

    def _usage(self) -> JSON:
        prompt = self.prompt_tokens
        completion = sum(f.completion_tokens for f in self._finishes.values())
        # Each choice's prompt was prefilled on its own: the least any of them found cached.
        cached = min(f.cached_tokens for f in self._finishes.values())
        usage: JSON = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        chats = [c for c in self.choices if isinstance(c, ChatChoice)]
        if chats:  # OpenAI's count of the reasoning's tokens among the completion's
            reasoning = sum(c.reasoning_tokens for c in chats)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def _chunk(self, choice: JSON) -> JSON:
        chunk = {**self._chunk_head, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self._tokens_out,
                "total_tokens": self.prompt_tokens + self._tokens_out,
            }
        elif self.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk but the last carries usage: null
        return chunk

    def _head(self, obj: str) -> JSON:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
