"""Content hashes of token blocks: the names of cached prefixes, in the engine and in the router.

Block i of a token sequence is tokens [i*B, (i+1)*B); its hash chains the hash of block i-1 (the
salt, for block 0) with the block's ids, so two sequences share block i's hash exactly when they
share their first (i+1)*B tokens (up to a 2^-128 collision; the engine also compares the tokens).
Only whole blocks are hashed. The salt names everything that makes two caches' bytes mean the
same thing: the model, the KV layout (which names the dtype and --kv-cache-dtype), so that no hash
of one can match the other's.

Torch-free: the router hashes prompts with a worker's salt and block size to route them to the
worker holding their prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def cache_salt(*parts: str) -> bytes:
    """The hash that block 0 chains from: what the cache's bytes depend on besides the tokens."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=DIGEST_BYTES).digest()


def salted(salt: bytes, cache_salt: str | None) -> bytes:
    """The salt of one request's cache namespace: the cache's salt with the request's
    `cache_salt` mixed in (vLLM's request field; the router also puts the API key's tenant
    there), so requests with different ones share no block hash; without one, the cache's."""
    if not cache_salt:
        return salt
    return hashlib.blake2b(salt + b"\0" + cache_salt.encode(), digest_size=DIGEST_BYTES).digest()


def block_hashes(
    tokens: Sequence[int], salt: bytes, block: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every whole block of `tokens`; `known`: the hashes of its first blocks, already
    computed (a request whose tokens grew), which are kept and chained from."""
    out = list(known)
    prev = out[-1] if out else salt
    for i in range(len(out), len(tokens) // block):
        ids = array("I", tokens[i * block : (i + 1) * block]).tobytes()
        prev = hashlib.blake2b(prev + ids, digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out
