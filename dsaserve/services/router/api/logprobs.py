"""The workers' token logprobs in OpenAI's two shapes.

Chat: `choices[].logprobs.content[]`, one entry per token with `token`, `logprob`, `bytes` and
`top_logprobs` (the k likeliest, each with the same three fields). Completions (the legacy
shape): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob} object
per token: the k likeliest and the sampled token, so up to k + 1 entries, as OpenAI documents)
and `text_offset`. Streamed chunks carry the same shapes for their own tokens.

A token's `bytes` are exactly the bytes it adds to the text, so clients can rebuild characters
split across tokens; its `token` is those bytes decoded, with U+FFFD for a partial character.
Special tokens (the end-of-sequence token that ended a reply) are listed under their marker text.
`text_offset` is where each token's text begins in the completion text, in characters from 0; a
token that ends a character split across tokens begins where that character does, and text a
stop string cut off lies past the end of the returned text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.text.text_stream import IncrementalDetokenizer
from dsaserve.engine.text.tokenizer import Tokenizer
from dsaserve.services.rpc import pb

JSON = dict[str, Any]


class TokenTexts:
    """A token id's OpenAI `token` string and `bytes`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def entry(self, token_id: int, logprob: float) -> JSON:
        data = self.tokenizer.token_bytes(token_id)
        return {
            "token": data.decode("utf-8", errors="replace"),
            "logprob": _finite(logprob),
            "bytes": list(data),
        }

    def token(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_entries(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprob]
) -> list[JSON]:
    """`logprobs.content` entries for these tokens."""
    return [
        {
            **texts.entry(token_id, lp.logprob),
            "top_logprobs": [
                texts.entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        }
        for token_id, lp in zip(token_ids, logprobs, strict=True)
    ]


class CompletionLogprobs:
    """One completion's legacy logprobs, a chunk of tokens at a time (text offsets carry on)."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._detokenizer = IncrementalDetokenizer(texts.tokenizer)
        self._emitted = 0  # characters the detokenizer has emitted

    def _offset(self, token_id: int) -> int:
        """Where token `token_id`'s text begins: the first character its bytes change. A token
        that finishes a character split across tokens begins where that character does."""
        before = self._detokenizer.held()
        piece = self._detokenizer.push(token_id)
        after = piece + self._detokenizer.held()
        same = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
            min(len(before), len(after)),
        )
        offset = self._emitted + same
        self._emitted += len(piece)
        return offset

    def chunk(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[pb.TokenLogprob | None],
        k: int | None = None,
    ) -> JSON:
        """These tokens' entries; a None logprob (an echoed prompt's first token, which nothing
        predicts) lists null; `k`: list at most k alternatives (None: all that came)."""
        body: JSON = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            body["text_offset"].append(self._offset(token_id))
            token = self._texts.token(token_id)
            body["tokens"].append(token)
            if lp is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(_finite(lp.logprob))
            top = {
                self._texts.token(i): _finite(v)
                for i, v in list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))[:k]
            }
            body["top_logprobs"].append({**top, token: _finite(lp.logprob)})
        return body


@dataclass(frozen=True)
class PromptLogprobs:
    """vLLM's `prompt_logprobs` of one prompt, `k` alternatives per token."""

    texts: TokenTexts
    token_ids: Sequence[int]
    k: int

    def entries(self, logprobs: Sequence[pb.TokenLogprob]) -> list[JSON | None]:
        """null for the first prompt token, then per token {id: {logprob, rank, decoded_token}}
        for its k likeliest alternatives (ranks 1..k) and the token itself (its rank null when
        it is not among them); `logprobs`: the prefill worker's, one per token after the first."""
        out: list[JSON | None] = [None]
        for token_id, lp in zip(self.token_ids[1:], logprobs, strict=True):
            top = list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))[: self.k]
            entry = {
                str(i): {"logprob": _finite(v), "rank": r + 1, "decoded_token": self.texts.token(i)}
                for r, (i, v) in enumerate(top)
            }
            entry.setdefault(
                str(token_id),
                {
                    "logprob": _finite(lp.logprob),
                    "rank": None,
                    "decoded_token": self.texts.token(token_id),
                },
            )
            out.append(entry)
        return out


def merge_completion_chunks(chunks: Sequence[JSON]) -> JSON:
    """One completion's logprobs from its chunks."""
    return {key: [v for chunk in chunks for v in chunk[key]] for key in _COMPLETION_KEYS}


_COMPLETION_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def _finite(value: float) -> float:
    # JSON has no -Infinity; a token the model gave no chance (it cannot be sampled, but may be
    # listed among the alternatives) gets -9999.0 instead, as in vLLM.
    return value if math.isfinite(value) else -9999.0
