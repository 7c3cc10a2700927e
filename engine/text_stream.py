"""Incremental output text of one request, with stop strings.

Text that could still grow into a stop string is held back, so a streamed response never
shows a stop string or any part of one; when a stop string appears, the text ends right
before it.
"""

from __future__ import annotations

from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False  # a stop string ended the text

    def push(self, token_id: int) -> None:
        """Add a token's text (callers skip eos and stop tokens, whose text is never shown)."""
        if self.stopped:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += self._detok.push(token_id)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def take(self, finished: bool) -> str:
        """The text not handed out yet; while unfinished, minus what a stop string could claim."""
        if finished and not self.stopped:
            self.text += self._detok.flush()
        end = len(self.text) if finished or self.stopped else len(self.text) - self._hold
        piece = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece
