"""Agent descriptors in Redis: `SET dsaserve:nixl:<agent> <descriptor> PX <ttl ms>`.

A worker publishes at start and again from its heartbeat, so a dead worker's descriptor expires
with it. No Redis import at runtime: callers pass their `redis.asyncio.Redis` client, and the
transfer package stays importable where redis-py is absent (the GPU benchmark machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis.asyncio

    from .kv_transfer import KVTransfer

KEY_PREFIX = "dsaserve:nixl:"


def descriptor_key(agent_name: str) -> str:
    return KEY_PREFIX + agent_name


async def publish_descriptor(
    redis: redis.asyncio.Redis, transfer: KVTransfer, ttl_s: float
) -> None:
    """(Re)publish our descriptor with a TTL; safe from the event loop's thread."""
    key, ttl_ms = descriptor_key(transfer.agent_name), max(1, round(ttl_s * 1000))
    await redis.set(key, transfer.descriptor(), px=ttl_ms)


async def fetch_descriptor(redis: redis.asyncio.Redis, agent_name: str) -> bytes | None:
    """A peer's published descriptor; None if it never published or its TTL ran out."""
    value = await redis.get(descriptor_key(agent_name))
    # Descriptors are ASCII JSON, so a client made with decode_responses=True loses nothing.
    return value.encode("ascii") if isinstance(value, str) else value
