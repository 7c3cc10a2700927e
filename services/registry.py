"""Who is alive: workers heartbeat a record into Redis under a TTL, the router watches.

Each worker owns one key, `dsaserve:worker:<worker_id>`, holding its `WorkerRecord` as JSON with a
TTL (default 6 s). `WorkerRegistration` rewrites it every TTL/3 with fresh load numbers, so two
missed beats still leave it alive and a dead worker's key expires on its own. `RegistryWatcher`
re-reads all keys every TTL/2 (SCAN + MGET), so a worker that stops beating leaves the router's
snapshot within TTL + TTL/2 < 2 TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

from engine.load import Load

log = logging.getLogger(__name__)

KEY_PREFIX = "dsaserve:worker:"
DEFAULT_TTL_S = 6.0
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    role: Role
    address: str  # gRPC host:port
    model: str
    layout_hash: str  # a prefill and a decode worker pair up only when these are equal
    nixl_agent: str  # NIXL agent name; services/transfer publishes its descriptor
    load: Load = field(default_factory=Load)
    started_at: float = field(default_factory=time.time)  # unix seconds

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parse a record; unknown keys are ignored so newer workers can add fields."""
        data: dict[str, Any] = json.loads(text)
        if data.get("role") not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {data.get('role')!r}")
        load_fields = {f.name for f in dataclasses.fields(Load)}
        load = Load(**{k: int(v) for k, v in (data.get("load") or {}).items() if k in load_fields})
        known = {f.name for f in dataclasses.fields(cls)} - {"load"}
        return cls(**{k: v for k, v in data.items() if k in known}, load=load)


def worker_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


def _client(redis_url: str, ttl_s: float) -> aioredis.Redis:
    # Socket timeouts bound every command: a hung Redis must not hang a heartbeat or a refresh.
    timeout = max(0.5, ttl_s / 3)
    return aioredis.Redis.from_url(
        redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
    )


class WorkerRegistration:
    """Keeps one worker's record in Redis while it runs.

    `load_fn` is called on every beat for the current load. `on_beat`, if given, runs after each
    write with the same client (e.g. to republish the NIXL descriptor under the same TTL).
    """

    def __init__(
        self,
        redis_url: str,
        record: WorkerRecord,
        load_fn: Callable[[], Load],
        ttl_s: float = DEFAULT_TTL_S,
        on_beat: Callable[[aioredis.Redis], Awaitable[None]] | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.record = record
        self._redis_url = redis_url
        self._load_fn = load_fn
        self._ttl_s = ttl_s
        self._on_beat = on_beat
        self._redis: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Write the record once (raising if Redis is unreachable), then heartbeat."""
        self._redis = _client(self._redis_url, self._ttl_s)
        await self._beat()
        self._task = asyncio.create_task(
            self._heartbeat(), name=f"registry-heartbeat-{self.record.worker_id}"
        )

    async def stop(self) -> None:
        """Stop beating and delete the key, so the router stops routing here at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._redis is not None:
            try:
                await self._redis.delete(worker_key(self.record.worker_id))
            except (aioredis.RedisError, OSError) as e:  # the key will expire on its own
                log.warning("could not delete %s from the registry: %s", self.record.worker_id, e)
            await self._redis.aclose()
            self._redis = None

    async def _beat(self) -> None:
        assert self._redis is not None
        self.record = dataclasses.replace(self.record, load=self._load_fn())
        ttl_ms = max(1, round(self._ttl_s * 1000))
        await self._redis.set(worker_key(self.record.worker_id), self.record.to_json(), px=ttl_ms)
        if self._on_beat is not None:
            await self._on_beat(self._redis)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._beat()
            except (aioredis.RedisError, OSError) as e:
                # Keep beating: a short Redis outage must not take a healthy worker out for good.
                log.warning("registry heartbeat for %s failed: %s", self.record.worker_id, e)


class RegistryWatcher:
    """An in-memory snapshot of the live workers, refreshed every TTL/2."""

    def __init__(self, redis_url: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._redis_url = redis_url
        self._ttl_s = ttl_s
        self._redis: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._snapshot: list[WorkerRecord] = []
        self._refreshed_at = 0.0  # monotonic time of the last successful refresh

    async def start(self) -> None:
        """Read the registry once (raising if Redis is unreachable), then keep refreshing."""
        self._redis = _client(self._redis_url, self._ttl_s)
        try:
            await self.refresh()
        except BaseException:
            await self._redis.aclose()
            self._redis = None
            raise
        self._task = asyncio.create_task(self._watch(), name="registry-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def workers(self, role: Role, model: str | None = None) -> list[WorkerRecord]:
        return [w for w in self._snapshot if w.role == role and (model is None or w.model == model)]

    async def refresh(self) -> None:
        """Replace the snapshot with what Redis holds now."""
        assert self._redis is not None, "start() the watcher first"
        keys = [key async for key in self._redis.scan_iter(match=KEY_PREFIX + "*", count=1000)]
        values = await self._redis.mget(keys) if keys else []
        records = []
        for key, value in zip(keys, values, strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                records.append(WorkerRecord.from_json(value))
            except (ValueError, TypeError) as e:
                log.warning("ignoring malformed registry entry %r: %s", key, e)
        self._snapshot = sorted(records, key=lambda w: w.worker_id)
        self._refreshed_at = time.monotonic()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 2)
            try:
                await self.refresh()
            except (aioredis.RedisError, OSError) as e:
                log.warning("registry refresh failed: %s", e)
                # Without Redis we cannot tell who is alive; stale records would route to the dead.
                if time.monotonic() - self._refreshed_at > self._ttl_s:
                    self._snapshot = []
