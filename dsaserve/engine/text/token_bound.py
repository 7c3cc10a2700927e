"""A lower bound on how many tokens a text becomes, without tokenizing it.

If no token covers more than `m` characters of input, a text of `n` characters needs at least
`ceil(n / m)` tokens. The router uses this to refuse a prompt that cannot fit the context before
spending seconds tokenizing megabytes of it. The bound must never be too high (that would refuse
a prompt that fits), so it is given only for tokenizers whose every step keeps or adds
characters, never drops or merges them, and `m` is taken over everything a token can stand for:

- vocabulary entries of a BPE model: with a byte-level pre-tokenizer each vocabulary character
  stands for one byte, and one input character is at least one byte; otherwise an entry's
  characters are the input's (Metaspace swaps a space for '▁' one for one) or more (byte-fallback
  entries like '<0x41>', subword prefixes like '##');
- added tokens, which match their literal content; one that strips whitespace next to it covers
  an unbounded run, so it rules the bound out.

Anything not known to keep characters (a normalizer that composes or strips, a pre-tokenizer that
removes whitespace, WordPiece or WordLevel whose unknown word becomes one token, truncation)
gives no bound.
"""

from __future__ import annotations

from typing import Any

# Normalizers that never shorten the text (decomposition, case folding and the byte map at most
# lengthen it).
_NORMALIZERS = {"Lowercase", "Prepend", "NFD", "NFKD", "ByteLevel"}
# Pre-tokenizers that only split (and ByteLevel/Metaspace map characters one for one).
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_chars_per_token(tokenizer: dict[str, Any]) -> int | None:
    """The most input characters one token can cover, from a tokenizer.json document; None when
    the tokenizer may drop or merge characters, so that no sound bound exists."""
    if tokenizer.get("truncation") is not None:
        return None
    if not _keeps_chars(tokenizer.get("normalizer"), "normalizers", _NORMALIZERS):
        return None
    if not _keeps_chars(tokenizer.get("pre_tokenizer"), "pretokenizers", _PRE_TOKENIZERS):
        return None
    model = tokenizer.get("model") or {}
    # A fused run of unknown characters is one token, however long.
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")):
        return None
    added = tokenizer.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    lengths = [len(entry) for entry in model.get("vocab") or {}]
    lengths += [len(t["content"]) for t in added]
    return max(lengths, default=None)


def _keeps_chars(step: dict[str, Any] | None, children: str, safe: set[str]) -> bool:
    if step is None:
        return True
    if step.get("type") == "Sequence":
        return all(_keeps_chars(s, children, safe) for s in step.get(children, []))
    return step.get("type") in safe and step.get("behavior") != "Removed"


def min_tokens(text: str, max_chars: int) -> int:
    """At least this many tokens encode `text` (`max_chars` from `max_chars_per_token`)."""
    return -(-len(text) // max_chars)
