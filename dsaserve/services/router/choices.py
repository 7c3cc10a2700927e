"""One choice of an answer, built from its generation's events: streamed chunks and the whole.

Streaming and non-streaming answers go through the same calls: every `Token` goes to `chunk`
(the streamed choice, or None when it has nothing to show yet) or, for a whole answer, only to
`record`; the `Finish` to `finish`, and a whole answer is then `answer()`. So a chat reply is
parsed once, by one `StreamParser`, however it is delivered: reasoning into
`reasoning_content`, DSML tool calls into `tool_calls`, the rest into `content`, and no markup
anywhere.

Logprobs (and prompt logprobs, echoed prompts' logprobs) are kept as the workers sent them, in
their compact wire form, and rendered into JSON objects only where they are written: a chunk's
when it is streamed, a whole answer's one choice at a time (`answer()`, called as the answer is
written, envelopes.Reply.answer_parts). A choice thus never holds its entries as Python objects
(tens of times their wire size) for longer than it takes to write them.

Finish reasons: "length" when the reply was cut by max_tokens or the context (whatever was
open stays open: reasoning, or a call with partial arguments); "tool_calls" when a reply that
ended by itself holds tool calls, all complete; else "stop". A call that EOS cut short is no
call: the whole answer leaves it out, and its reply finishes with "stop" (a client that trusts
"tool_calls" never meets arguments that are not JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.text.chat import (
    ContentDelta,
    Event,
    ReasoningDelta,
    StreamParser,
    ToolCallArguments,
    ToolCallStart,
)
from dsaserve.services.router.api.logprobs import (
    CompletionLogprobs,
    PromptLogprobs,
    TokenTexts,
    chat_entries,
    merge_completion_chunks,
)
from dsaserve.services.router.chat import ChatPrompt
from dsaserve.services.router.pd import Finish, Token
from dsaserve.services.rpc import pb

JSON = dict[str, Any]


class ChatChoice:
    def __init__(
        self,
        index: int,
        prompt: ChatPrompt,
        texts: TokenTexts | None,
        prompt_logprobs: PromptLogprobs | None = None,
        think_end: int | None = None,
    ) -> None:
        """think_end: the `</think>` token, where it is one (reasoning tokens are counted up
        to it; else up to the chunk whose text ends the reasoning)."""
        self.index = index
        self._prompt = prompt
        self._think_end = think_end
        self._reasoning_open = prompt.opens_reasoning
        self.reasoning_tokens = 0  # output tokens of the reasoning, `</think>` included
        self._texts = texts  # None: no logprobs
        self._prompt_logprobs = prompt_logprobs
        self._prompt_scores: Sequence[pb.TokenLogprob] | None = None  # from the first token
        self._parser = StreamParser(
            prompt.opens_reasoning, dialect=prompt.dialect if prompt.offers_tools else None
        )
        self._scored: list[tuple[Sequence[int], Sequence[pb.TokenLogprob]]] = []  # (ids, lps)
        self._finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or token id

    def opening(self) -> JSON:
        return self._choice({"role": "assistant", "content": ""}, None)

    def record(self, token: Token) -> list[Event]:
        """Take a token in (a whole answer's way); its reply events."""
        if self._prompt_scores is None:
            self._prompt_scores = _prompt_scores(token, self._prompt_logprobs)
        if self._texts is not None:
            self._scored.append((token.token_ids, _scores(token)))
        events = self._parser.feed(token.text)
        if self._reasoning_open:
            self._count_reasoning(token)
        return events

    def chunk(self, token: Token) -> JSON | None:
        delta = self._delta(self.record(token))
        entries = [] if self._texts is None else self._entries([self._scored[-1]])
        if not delta and not entries:
            return None
        return self._choice(delta, {"content": entries, "refusal": None} if entries else None)

    def prompt_logprobs(self) -> list[JSON | None] | None:
        """vLLM's prompt_logprobs, when asked (rendered now)."""
        if self._prompt_logprobs is None or self._prompt_scores is None:
            return None
        return self._prompt_logprobs.entries(self._prompt_scores)

    def finish(self, finish: Finish) -> JSON:
        delta = self._delta(self._parser.finish())
        calls = self._calls()
        self._finish_reason, self.stop_reason = finish.reason, finish.stop_reason
        if finish.reason == "stop" and calls and all(call.complete for call in calls):
            self._finish_reason = "tool_calls"
        return {**self._choice(delta, None, self._finish_reason), "stop_reason": self.stop_reason}

    def answer(self) -> JSON:
        parsed = self._parser.message()
        calls = self._calls()
        message: JSON = {"role": "assistant", "content": parsed.content}
        if calls and not parsed.content:
            message["content"] = None  # OpenAI's shape of a reply that is only tool calls
        if self._prompt.opens_reasoning:
            message["reasoning_content"] = parsed.reasoning_content
        if calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        logprobs = None
        if self._texts is not None:
            logprobs = {"content": self._entries(self._scored), "refusal": None}
        return {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason,
            "stop_reason": self.stop_reason,
        }

    def _count_reasoning(self, token: Token) -> None:
        ids = token.token_ids
        if self._think_end is not None and self._think_end in ids:
            self.reasoning_tokens += ids.index(self._think_end) + 1
            self._reasoning_open = False
            return
        self.reasoning_tokens += len(ids)
        if self._think_end is None and not self._parser.reasoning:
            self._reasoning_open = False  # (this chunk's text ended it)

    def _calls(self) -> tuple:
        calls = self._parser.message().tool_calls
        if self._finish_reason == "stop":
            calls = tuple(call for call in calls if call.complete)
        return (
            calls if self._prompt.max_tool_calls is None else calls[: self._prompt.max_tool_calls]
        )

    def _entries(self, scored: list[tuple[Sequence[int], Sequence[pb.TokenLogprob]]]) -> list[JSON]:
        assert self._texts is not None
        return [e for ids, lps in scored for e in chat_entries(self._texts, ids, lps)]

    def _delta(self, events: list[Event]) -> JSON:
        """One delta for the events of one chunk; a call's first fragment names it."""
        delta: JSON = {}
        calls: dict[int, JSON] = {}
        limit = self._prompt.max_tool_calls
        for event in events:
            if isinstance(event, ReasoningDelta):
                delta["reasoning_content"] = delta.get("reasoning_content", "") + event.text
            elif isinstance(event, ContentDelta):
                delta["content"] = delta.get("content", "") + event.text
            elif limit is not None and event.index >= limit:
                continue
            elif isinstance(event, ToolCallStart):
                calls[event.index] = {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            elif isinstance(event, ToolCallArguments):
                call = calls.setdefault(
                    event.index, {"index": event.index, "function": {"arguments": ""}}
                )
                call["function"]["arguments"] += event.fragment
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta

    def _choice(self, delta: JSON, logprobs: JSON | None, finish_reason: str | None = None) -> JSON:
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, written before its text (`echo`)."""

    text: str
    token_ids: list[int]
    logprobs: int | None  # the request's `logprobs`: its tokens' then come first, the first null


class TextChoice:
    def __init__(
        self,
        index: int,
        texts: TokenTexts | None,
        echo: Echo | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        self.index = index
        self._texts_of = texts  # None: no logprobs
        self._streamed = None if texts is None else CompletionLogprobs(texts)  # (its offsets)
        self._echo = echo
        self._prompt_logprobs = prompt_logprobs
        self._prompt_scores: Sequence[pb.TokenLogprob] | None = None  # from the first token
        self._texts: list[str] = []
        # What the logprobs list, in order: (token ids, their logprobs, alternatives shown)
        self._scored: list[tuple[Sequence[int], Sequence[pb.TokenLogprob | None], int | None]] = []
        self._finish_reason: str | None = None
        self._stop_reason: str | int | None = None  # vLLM's: the stop string or token id

    def opening(self) -> None:
        return None

    def record(self, token: Token) -> str:
        """Take a token in (a whole answer's way); the text it adds."""
        text = token.text
        if self._prompt_scores is None:  # the first event brings what the prompt shows
            self._prompt_scores = _prompt_scores(token, self._prompt_logprobs)
            if self._echo is not None:
                text = self._echo.text + text
                if self._texts_of is not None:
                    scores = [None, *_prompt_scores(token, self._echo)]
                    self._scored.append((self._echo.token_ids, scores, self._echo.logprobs))
        self._texts.append(text)
        if self._texts_of is not None:
            self._scored.append((token.token_ids, _scores(token), None))
        return text

    def chunk(self, token: Token) -> JSON | None:
        before = len(self._scored)
        text = self.record(token)
        logprobs = None
        if self._streamed is not None:
            logprobs = _completion_logprobs(self._streamed, self._scored[before:])
        if not text and not (logprobs and logprobs["tokens"]):
            return None
        return self._choice(text, logprobs)

    def finish(self, finish: Finish) -> JSON:
        self._finish_reason, self._stop_reason = finish.reason, finish.stop_reason
        return {**self._choice("", None, finish.reason), "stop_reason": self._stop_reason}

    def answer(self) -> JSON:
        logprobs = None
        if self._texts_of is not None:
            logprobs = _completion_logprobs(CompletionLogprobs(self._texts_of), self._scored)
        choice = self._choice("".join(self._texts), logprobs, self._finish_reason)
        choice["stop_reason"] = self._stop_reason
        if self._prompt_logprobs is not None and self._prompt_scores is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs.entries(self._prompt_scores)
        return choice

    def _choice(self, text: str, logprobs: JSON | None, finish_reason: str | None = None) -> JSON:
        return {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }


# What is rendered only when the answer is written is checked when it arrives: a worker's
# malformed reply is then the request's error, not a body cut off once its 200 went out.


def _scores(token: Token) -> Sequence[pb.TokenLogprob]:
    """A token event's logprobs, one per token id."""
    if len(token.logprobs) != len(token.token_ids):
        raise ValueError(f"{len(token.logprobs)} logprobs for {len(token.token_ids)} tokens")
    return token.logprobs


def _prompt_scores(token: Token, prompt: PromptLogprobs | Echo | None) -> Sequence[pb.TokenLogprob]:
    """The first event's prompt logprobs, one per prompt token after the first where `prompt`
    (scored, or echoed) asks for them."""
    if prompt is None or isinstance(prompt, Echo) and prompt.logprobs is None:
        return token.prompt_logprobs
    if len(token.prompt_logprobs) != len(prompt.token_ids) - 1:
        raise ValueError(
            f"{len(token.prompt_logprobs)} prompt logprobs for {len(prompt.token_ids)} tokens"
        )
    return token.prompt_logprobs


def _completion_logprobs(
    logprobs: CompletionLogprobs,
    scored: Sequence[tuple[Sequence[int], Sequence[pb.TokenLogprob | None], int | None]],
) -> JSON:
    """The legacy logprobs of these pieces, in order (`logprobs` carries the text offsets on)."""
    return merge_completion_chunks([logprobs.chunk(ids, lps, k) for ids, lps, k in scored])


Choice = ChatChoice | TextChoice
