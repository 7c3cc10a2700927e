"""Timing one streamed OpenAI chat completion, line by line, for both load generators.

The client measures on its side of the wire, so TTFT includes routing, queueing, prefill and the
KV hand-off, exactly what a user waits for. Parsing is pure (lines in, numbers out) so it can be
tested on recorded timings without a server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def chat_payload(
    model: str, prompt: str | list[dict[str, str]], max_tokens: int, *, ignore_eos: bool = True
) -> dict[str, Any]:
    """A streaming chat request with a fixed output length; `prompt`: the user's message, or
    the whole conversation so far.

    `ignore_eos` (a vLLM/SGLang extension dsaserve honours) plus `max_tokens` makes every request
    generate exactly `max_tokens` tokens, so runs compare like with like. `include_usage` asks for
    the server's own token counts in the last chunk, which beat counting chunks.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def auth_headers(api_key: str | None) -> dict[str, str]:
    # DSASERVE_API_KEY may hold several comma-separated keys (the router takes any): the first.
    key = (api_key or "").split(",")[0].strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(slots=True)
class StreamRecord:
    """What one streamed request did. Times are seconds on the caller's clock (perf_counter)."""

    start: float
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    chunks: int = 0  # chunks that carried content
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, found in the server's prefix cache
    text: list[str] = field(default_factory=list)  # the content, chunk by chunk
    error: str | None = None
    done: bool = False  # saw `data: [DONE]`
    retries: int = 0  # connection errors before the response that the client retried
    _usage_tokens: int | None = None
    _last: float | None = None

    @property
    def ok(self) -> bool:
        return self.done and self.error is None

    def feed(self, line: str, now: float) -> None:
        """Account for one SSE line received at `now`."""
        line = line.rstrip("\r\n")
        if not line.startswith("data:") or self.done:
            return  # blank separators, `:` comments, `event:`/`id:` fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            self.latency = now - self.start
            return
        try:
            event = json.loads(data)
        except ValueError:
            # Includes SGLang's `data: {'error': ...}` (Python repr, not JSON): still a failure.
            self._fail(f"unparseable stream event: {data[:200]}")
            return
        if not isinstance(event, dict):
            self._fail(f"unexpected stream event: {data[:200]}")
        elif "error" in event:
            self._fail(f"error event in stream: {_error_message(event['error'])}")
        else:
            self._account(event, now)

    def finish(self, now: float) -> None:
        """Close the record when the body ends (or the caller gives up)."""
        if self.latency is None:
            self.latency = now - self.start
        if not self.done:
            self._fail("stream ended before data: [DONE]")
        self.output_tokens = self._usage_tokens if self._usage_tokens is not None else self.chunks

    def _account(self, event: dict[str, Any], now: float) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage_tokens = usage.get("completion_tokens", self._usage_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens = details.get("cached_tokens", self.cached_tokens)
        choices = [c for c in event.get("choices") or () if _has_content(c)]
        if not choices:
            return  # the role-only first delta and the usage-only last chunk are not tokens
        self.text.extend(
            (c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices
        )
        if self._last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.chunks += 1

    def _fail(self, message: str) -> None:
        if self.error is None:  # the first cause is the interesting one
            self.error = message


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta") or {}
    # `text` for /v1/completions; reasoning models stream their thinking as reasoning_content.
    return bool(delta.get("content") or delta.get("reasoning_content") or choice.get("text"))


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
