"""Incremental detokenizing: token ids in, text pieces out, as tokens arrive.

`IncrementalDetokenizer` never cuts a UTF-8 character in half; `TextStream` (one request's
output text) adds stop strings on top: text that could still grow into a stop string is held
back, so a streamed response never shows a stop string or any part of one; when a stop string
appears, the text ends right before it.
"""

from __future__ import annotations

from dsaserve.engine.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what decoding puts in place of an incomplete or invalid UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never cutting a UTF-8 character in half.

    Concatenating the pushed pieces and `flush()` gives `tokenizer.decode(token_ids)`. Each push
    decodes only a short window of recent tokens (vLLM's prefix/read offsets): text is emitted
    relative to tokens already emitted, so decoders that treat the first token specially (a
    stripped leading space) still give the same text as one decode of the whole stream.
    """

    # A character is at most 4 UTF-8 bytes, so an unfinished one has at most 3, in at most 3
    # tokens (assuming each token carries a byte). Anything older can be emitted.
    _MAX_PARTIAL_TOKENS = 3

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: context, already emitted
        self._read_offset = 0  # tokens before this are emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        end = len(self._ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, end)
        if not window.endswith(_REPLACEMENT):
            # Shorter or equal text means the new tokens added nothing yet (e.g. a skipped
            # special token); waiting keeps the window's first token the same for decoders
            # that strip a leading space from it.
            if len(window) <= len(prefix_text):
                return ""
            return self._emit(window[len(prefix_text) :], end)
        # The window ends in U+FFFD: perhaps half a character. Hold the last tokens back but
        # emit older ones once their text is settled, so a long run of invalid bytes cannot
        # grow the window (and the cost of a push) without bound.
        split = end - self._MAX_PARTIAL_TOKENS
        if split > self._read_offset:
            head = self._decode(self._prefix_offset, split)
            # Equal means no character straddles `split`, so later tokens cannot change `head`.
            if head + self._decode(split, end) == window:
                return self._emit(head[len(prefix_text) :], split)
        return ""

    def held(self) -> str:
        """The text of the tokens held back, as `flush` would emit it now (nothing is emitted)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        return window[len(prefix_text) :]

    def flush(self) -> str:
        """Emit whatever is held back, an unfinished character as U+FFFD (at end of stream)."""
        return self._emit(self.held(), len(self._ids))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _emit(self, piece: str, read_offset: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._pieces.append(piece)
        return piece


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, token_id: int, search: bool = True) -> None:
        """Add a token's text (callers skip eos and stop tokens, whose text is never shown);
        `search`: whether a stop string may end the text here (vLLM's min_tokens: not yet)."""
        if self.stopped:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += self._detok.push(token_id)
        if not search:
            return
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.stopped = min(hits)
            self.text = self.text[:at]

    def take(self, finished: bool) -> str:
        """The text not handed out yet; while unfinished, minus what a stop string could claim."""
        if finished and not self.stopped:
            self.text += self._detok.flush()
        end = len(self.text) if finished or self.stopped else len(self.text) - self._hold
        piece = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece
