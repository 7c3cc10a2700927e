"""Which decode worker decoded each generation this router saw to its end, by its tokens.

A decode worker keeps a finished generation's prompt and answer in its prefix cache
(engine.prefix_cache.cache.keep); the prefill worker computing the conversation's next turn
never computed that answer and borrows its state from that decode worker (engine.loans). The
cache index (services.kv_events) counts whole blocks only, and a turn's answer often ends inside
the block the last prompt ended in, where both workers look alike to it; so the router keeps what
it knows exactly: each generation's tokens, as the chained hash of their whole blocks and the
tokens after them. A prompt that starts with all of a recorded generation's tokens, and goes on,
is its conversation's next turn. Bounded, oldest forgotten first: a forgotten conversation only
borrows nothing (its prefill computes the last answer again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dsaserve.engine.prefix_cache.block_hash import block_hashes, cache_salt, salted

BLOCK = 64  # tokens hashed together (the router's own: it need not match a worker's)
CAPACITY = 100_000  # generations remembered, about 20 MB of tails at most
SALT = cache_salt("router-conversations")


class Conversations:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        # (hash of the whole blocks, the tokens after them) -> the decode worker that kept them,
        # oldest first; and the tails recorded after each hash
        self._ends: OrderedDict[tuple[bytes, tuple[int, ...]], str] = OrderedDict()
        self._tails: dict[bytes, set[tuple[int, ...]]] = {}

    def decoded(self, worker_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> None:
        """`worker_id` decoded a generation to its end: its prompt and answer, `tokens`, in the
        prefix-cache namespace `cache_salt`."""
        key = _key(tokens, block_hashes(tokens, salted(SALT, cache_salt), BLOCK), cache_salt)
        self._ends[key] = worker_id
        self._ends.move_to_end(key)
        self._tails.setdefault(key[0], set()).add(key[1])
        while len(self._ends) > self._capacity:
            (blocks, tail), _ = self._ends.popitem(last=False)
            self._tails[blocks].discard(tail)
            if not self._tails[blocks]:
                del self._tails[blocks]

    def holder(
        self, prompt: Sequence[int], cache_salt: str | None = None
    ) -> tuple[str, int] | None:
        """The decode worker holding the longest recorded generation of the namespace
        `cache_salt` that `prompt` starts with and goes past, and that generation's length;
        None: none."""
        root = salted(SALT, cache_salt)
        hashes = block_hashes(prompt, root, BLOCK)
        for blocks in range(len(hashes), -1, -1):  # (the longest first)
            start = blocks * BLOCK
            after = tuple(prompt[start : start + BLOCK])
            head = hashes[blocks - 1] if blocks else root
            found = [t for t in self._tails.get(head, ()) if len(t) < len(after)]
            found = [t for t in found if after[: len(t)] == t]
            if found:
                tail = max(found, key=len)
                return self._ends[head, tail], start + len(tail)
        return None


def _key(
    tokens: Sequence[int], hashes: Sequence[bytes], cache_salt: str | None
) -> tuple[bytes, tuple[int, ...]]:
    """A generation's whole blocks' chained hash (the namespace's root without one) and the
    tokens after them."""
    whole = len(tokens) // BLOCK
    head = hashes[whole - 1] if whole else salted(SALT, cache_salt)
    return head, tuple(tokens[whole * BLOCK :])
