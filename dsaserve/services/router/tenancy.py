"""Who a request belongs to: its tenant, a hash of the API key it presented.

The tenant owns what the router keeps for a request beyond its answer (stored Responses API
responses: another key gets 404, as if there were none) and names the partition of the prefix
cache the request may resume from: with `--prefix-cache-scope key` a prompt only ever hits
what the same key computed, so the time to its first token and `cached_tokens` tell one key
nothing about another's prompts. Only the hash leaves the router (into Redis and, mixed into the
prefix cache's salt, to the workers); the key itself is never stored.
"""

from __future__ import annotations

import hashlib
import hmac

_DOMAIN = b"dsaserve tenant\0"  # (so the hash is of no use as anything but a tenant id)


def tenant_of(api_key: str | None) -> str | None:
    """The tenant of a request made with `api_key` (None: a router without API keys)."""
    if api_key is None:
        return None
    return hashlib.sha256(_DOMAIN + api_key.encode()).hexdigest()[:32]


def same_tenant(a: str | None, b: str | None) -> bool:
    """Whether two tenants (either may be None: no key) are one, in constant time."""
    return hmac.compare_digest((a or "").encode(), (b or "").encode())


def cache_namespace(tenant: str | None, cache_salt: str | None, by_key: bool) -> str | None:
    """The prefix-cache namespace of a request (SamplingParams.cache_salt on the wire): its
    tenant's when the cache is partitioned by key, with its own `cache_salt` after it; None:
    the shared one. (Under one scope no two pairs make one string: by key every request has a
    tenant of 32 hex digits first, globally none has.)"""
    parts = [part for part in (tenant if by_key else None, cache_salt) if part]
    return ":".join(parts) if parts else None
