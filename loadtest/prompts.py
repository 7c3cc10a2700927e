"""Synthetic prompts of a chosen length, different for every request.

Random words, so no two requests share a prefix (a prefix cache would otherwise make TTFT look
better than real traffic gets). A word is about one token in BPE vocabularies but several in
byte-level ones (the tiny demo model: one token per byte), so lengths are made right in one of
three ways: a local tokenizer cuts the prompt to the exact count; else the server's token counts
for two probe prompts give tokens per word (`calibrated_words`); else words stand for tokens.
Either way the reports use the server's own `usage.prompt_tokens`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river stone light music paper garden window bridge market letter engine signal"
).split()

Tokenizer = Callable[[str], list[int]]


def load_tokenizer(path: str | None) -> tuple[Tokenizer, Callable[[list[int]], str]] | None:
    """(encode, decode) from a tokenizer.json file or a model folder holding one; None without."""
    if not path:
        return None
    from tokenizers import Tokenizer as HFTokenizer  # optional: only needed with --tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    tok = HFTokenizer.from_file(str(file))
    return (
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode(ids, skip_special_tokens=False),
    )


def make_prompt(
    length: int,
    rng: random.Random,
    tokenizer: tuple[Tokenizer, Callable[[list[int]], str]] | None = None,
) -> str:
    """`length` words, or `length` tokens when a tokenizer is given."""
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(length))
    encode, decode = tokenizer
    # Words are >= 1 token each, so `length` words cover `length` tokens: keep the first ones.
    ids = encode(" ".join(rng.choice(_WORDS) for _ in range(length)))
    return decode(ids[:length])


PROBE_WORDS = (8, 40)


def calibrated_words(target_tokens: int, probes: list[tuple[int, int]]) -> int:
    """Words for `target_tokens` prompt tokens, from (words, server prompt_tokens) of two probes.

    The difference of the two cancels the chat template's fixed tokens, leaving tokens per word.
    """
    (w1, t1), (w2, t2) = probes
    per_word = (t2 - t1) / (w2 - w1)
    if per_word <= 0:
        raise ValueError(f"probe prompts of {w1} and {w2} words gave {t1} and {t2} tokens")
    return max(1, round(target_tokens / per_word))
