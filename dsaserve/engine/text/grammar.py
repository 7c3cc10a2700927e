"""Grammars of constrained output, compiled for one tokenizer with llguidance, without torch.

A constrained request carries its grammar as llguidance's Lark-like text (what
`engine.text.reply_grammar` writes from a request's response_format and tools). Compiling it
for a tokenizer builds the lexer and the token trie walk; that is the expensive part, so a
`GrammarCompiler` keeps each grammar it compiled by its hash (least recently used out) and gives
every request a copy of the compiled matcher, which is cheap. The router validates with one, in
a process of its own under a time budget (a bad grammar is a 400 before any GPU work,
services.router.grammars), the engine constrains with another, compiled off the engine's thread
(llguidance drops the GIL while it compiles). What a matcher may spend computing one mask is
bounded by llguidance's parser limits (its defaults: ~15 ms of lexer fuel, 50,000 Earley items a
step); a grammar over them leaves the matcher in its error state, which ends that request only.

Why llguidance (and not xgrammar, which vLLM and SGLang default to): it compiles a JSON schema
lazily (an Earley parser over a derivative-based lexer), so a large or deeply nested schema
costs no up-front automaton build on the request path; it computes a mask in tens of
microseconds on a CPU with no GPU code of its own, so the router and CPU CI run the same code
as a GPU worker; its grammars mix token-level items (`<[id]>`, `<[^id,...]>`: any token but
these) with text, which is what "free reasoning until the `</think>` token, then JSON" needs;
and it reports which JSON-schema keyword it does not implement, which becomes the 400.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict

import llguidance

from dsaserve.engine.text.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A grammar (or the JSON schema in it) that cannot be compiled; the message names why,
    `param` the request field it came from where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the last `capacity` of them."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int] | None = None,
        capacity: int = 256,
    ) -> None:
        """eos_token_ids: the ids that end a reply, allowed where the grammar is complete
        (default: the tokenizer's)."""
        # Bits of the mask: one per token id of the tokenizer (a padded embedding's extra rows
        # are no tokens; the engine never samples them).
        self.vocab_size = tokenizer.vocab_size
        self._text_tokenizer = tokenizer
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(),
            n_vocab=tokenizer.vocab_size,
            eos_token=sorted(eos_token_ids or tokenizer.eos_token_ids),
        )
        self._compiled: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()  # by hash
        self._capacity = capacity
        self._lock = threading.Lock()  # grammars are compiled in threads

    def special_token(self, text: str) -> int | None:
        """The id of `text` where it is one token that llguidance keeps apart from text (a
        special token, `<...>`-shaped), so a grammar names it as `<[id]>`; else None."""
        ids = self._text_tokenizer.encode(text)
        if len(ids) == 1 and self._tokenizer.is_special_token(ids[0]):
            return ids[0]
        return None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of `grammar` at its start; raises GrammarError if it does not
        compile."""
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise GrammarError(_readable(compiled.get_error()))
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def check(self, grammar: str) -> None:
        """Raise GrammarError unless `grammar` compiles (and keep it compiled for later)."""
        self.matcher(grammar)


def _readable(error: str) -> str:
    """llguidance's error in one line: no location prefix, no grammar listing after it."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return re.sub(r"^(Error: )?at \d+\(\d+\): ", "", first)
