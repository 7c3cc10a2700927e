"""JSON from a store others can write (Redis): parsed only within a size and a nesting bound.

`json.loads` recurses once per nesting level, so a value of 200,000 nested arrays raises
RecursionError (not ValueError) deep in the decoder, and a task that expected only malformed
JSON dies of it. Here the nesting is counted first, by one scan that skips strings, and a value
over either bound is a ValueError like any other malformed one.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string (skipped whole: brackets inside it do not nest) or one bracket.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def loads(data: str | bytes, max_bytes: int, max_depth: int) -> Any:
    """The JSON value of `data`; ValueError if it is longer than `max_bytes`, nests deeper than
    `max_depth`, or is not JSON."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise ValueError(f"{len(raw)} bytes, more than the {max_bytes} allowed")
    depth = 0
    for token in _TOKENS.finditer(raw):
        opener = token.group()[0]
        if opener in b"[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
        elif opener in b"]}":
            depth -= 1
    return json.loads(raw)
