"""Who is alive: workers heartbeat a record into Redis under a TTL, the router watches.

Each worker owns one key, `dsaserve:worker:<worker_id>`, holding its `WorkerRecord` as JSON with a
TTL (default 6 s). `WorkerRegistration` rewrites it every TTL/3 with fresh load numbers, so two
missed beats still leave it alive and a dead worker's key expires on its own. `RegistryWatcher`
re-reads all keys every TTL/2 (SCAN + MGET), so a worker that stops beating leaves the router's
snapshot within TTL + TTL/2 < 2 TTL.

Redis is not on the request path: while it is unreachable the router keeps routing to the
workers it last saw (they were healthy then, and forgetting them would stop all traffic), and
says so (`RegistryWatcher.up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
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
    nixl_agent: str  # NIXL agent name (peers load its descriptor from the Describe RPC)
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

    `load_fn` is called on every beat for the current load.
    """

    def __init__(
        self,
        redis_url: str,
        record: WorkerRecord,
        load_fn: Callable[[], Load],
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.record = record
        self._redis_url = redis_url
        self._load_fn = load_fn
        self._ttl_s = ttl_s
        self._redis: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        """Write the record, then heartbeat; returns whether the first write landed.

        A worker that starts while Redis is down still serves: the router keeps the workers it
        saw through an outage, so a worker restarted at the same address takes requests again at
        once, and the heartbeat registers it when Redis is back."""
        self._redis = _client(self._redis_url, self._ttl_s)
        registered = True
        try:
            await self._beat()
        except (aioredis.RedisError, OSError) as e:
            registered = False
            log.warning(
                "registry unreachable (%s): %s serves and keeps trying to register",
                e,
                self.record.worker_id,
            )
        self._task = asyncio.create_task(
            self._heartbeat(), name=f"registry-heartbeat-{self.record.worker_id}"
        )
        return registered

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

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._beat()
            except (aioredis.RedisError, OSError) as e:
                # Keep beating: a short Redis outage must not take a healthy worker out for good.
                log.warning("registry heartbeat for %s failed: %s", self.record.worker_id, e)


class RegistryWatcher:
    """An in-memory snapshot of the live workers, refreshed every TTL/2.

    A worker leaves the snapshot only when a successful refresh no longer finds it: it
    deregistered, or its TTL expired. A failed refresh changes nothing. Nor does a worker's
    absence in the first TTL after Redis comes back: live workers may not have beaten since
    (a restarted Redis starts empty, a paused one expires every key when it resumes), so the
    snapshot keeps what it had until each of them had a TTL to write its record again.
    """

    def __init__(self, redis_url: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._redis_url = redis_url
        self._ttl_s = ttl_s
        self._redis: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._snapshot: list[WorkerRecord] = []
        self._up = False  # did the last refresh reach Redis?
        self._refreshed_at = 0.0  # monotonic time of the last successful refresh
        self._keep_until = 0.0  # monotonic time until which absent workers are kept

    @property
    def refresh_interval_s(self) -> float:
        """How often the snapshot is re-read: the longest a new worker waits to be seen."""
        return self._ttl_s / 2

    @property
    def up(self) -> bool:
        """Whether the last refresh reached Redis."""
        return self._up

    def last_refresh_age_s(self) -> float:
        """Seconds since the snapshot was last read from Redis."""
        return time.monotonic() - self._refreshed_at

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
        """Update the snapshot from what Redis holds now; on failure keep it and raise."""
        try:
            records = await self._read()
        except BaseException:
            self._up = False
            raise
        now = time.monotonic()
        if not self._up and self._refreshed_at:  # back after an outage
            self._keep_until = now + self._ttl_s
        self._up = True
        fresh = {w.worker_id: w for w in records}
        if now < self._keep_until:
            for worker in self._snapshot:  # may not have beaten since Redis came back: keep it
                fresh.setdefault(worker.worker_id, worker)
        self._snapshot = sorted(fresh.values(), key=lambda w: w.worker_id)
        self._refreshed_at = now

    async def _read(self) -> list[WorkerRecord]:
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
        return records

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            was_up = self._up
            try:
                await self.refresh()
            except (aioredis.RedisError, OSError) as e:
                if was_up:  # once per outage, not every refresh
                    log.warning(
                        "registry unreachable (%s); routing to the %d workers last seen "
                        "until it is back",
                        e,
                        len(self._snapshot),
                    )
                continue
            if not was_up:
                log.warning("registry reachable again; %d workers", len(self._snapshot))
