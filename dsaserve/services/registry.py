"""Who is alive: workers heartbeat a record into Redis under a TTL, the router watches.

Each worker owns one key, `dsaserve:worker:<worker_id>`, holding its `WorkerRecord` as JSON with a
TTL (default 6 s). `WorkerRegistration` rewrites it every TTL/3 with fresh load numbers, so two
missed beats still leave it alive and a dead worker's key expires on its own; and at once when
the key vanishes (a FLUSHALL, a DEL, a restarted Redis). `RegistryWatcher`
re-reads all keys every TTL/2 (SCAN + MGET), so a worker that stops beating leaves the router's
snapshot within TTL + TTL/2 < 2 TTL.

Redis is not on the request path: while it is unreachable the router keeps routing to the
workers it last saw (they were healthy then, and forgetting them would stop all traffic), and
says so (`RegistryWatcher.up`). Nor is it trusted: anyone who can write to it could plant a
record that draws prompts and the cluster token to their own address. So every record is
signed (`seal`: an HMAC-SHA256 keyed by the cluster token over the record and the time it was
written) and the watcher keeps only records whose signature verifies and whose time is within
a TTL (plus clock skew) of now, under the key their worker id names; a replayed old record of a
dead worker is as useless as a forged one. A value is read only when it is small
(MAX_RECORD_BYTES, checked in Redis before it is fetched) and parsed only when it nests
shallowly (MAX_RECORD_DEPTH): whatever someone writes under a worker key is ignored, never
fatal, and the watcher itself restarts after any error it did not expect (`restarts`,
`last_error`: the router's /health shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

from dsaserve.engine.load import Load
from dsaserve.services import bounded_json

log = logging.getLogger(__name__)

KEY_PREFIX = "dsaserve:worker:"
MARKER_PREFIX = "dsaserve:watcher:"  # + a watcher's id: its marker (RegistryWatcher._read)
MARKER_TTLS = 10  # a marker outlives its watcher by this many TTLs
DEFAULT_TTL_S = 6.0
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
# How far the clocks of a worker and a router may disagree (hosts run NTP: milliseconds apart).
MAX_CLOCK_SKEW_S = 5.0
INVALIDATE_CHANNEL = "__redis__:invalidate"  # where Redis sends client-side tracking's messages
KEY_WATCH_RETRY_S = 0.5  # a worker's key watch reconnects this often while Redis is down
# A signed record is ~500 bytes of flat JSON: anything much larger or deeper is not one.
MAX_RECORD_BYTES = 16 << 10
MAX_RECORD_DEPTH = 8


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
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerRecord:
        if not isinstance(data, dict):
            raise ValueError(f"a record is a JSON object, got {type(data).__name__}")
        if data.get("role") not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {data.get('role')!r}")
        load_fields = {f.name for f in dataclasses.fields(Load)}
        load = Load(**{k: int(v) for k, v in (data.get("load") or {}).items() if k in load_fields})
        known = {f.name for f in dataclasses.fields(cls)} - {"load"}
        return cls(**{k: v for k, v in data.items() if k in known}, load=load)


class UntrustedRecord(ValueError):
    """A registry value that is not a record signed with our cluster token, fresh, under its own
    key: forged, tampered with, replayed, or written by a worker with another token."""


def _signature(key: str, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(key.encode(), canonical.encode(), hashlib.sha256).hexdigest()


def seal(record: WorkerRecord, key: str, signed_at: float) -> str:
    """The registry value of `record`: the record, the unix time it was written, and an HMAC of
    both keyed by the cluster token `key`."""
    body = dataclasses.asdict(record) | {"signed_at": signed_at}
    return json.dumps({"record": body, "signature": _signature(key, body)}, separators=(",", ":"))


def unseal(
    redis_key: str | bytes, value: str | bytes, key: str, now: float, max_age_s: float
) -> WorkerRecord:
    """The record in a registry value, or UntrustedRecord (or ValueError: malformed).

    Trusted only when its HMAC verifies under `key`, it was written at most `max_age_s` before
    `now` (and not after it, both give or take MAX_CLOCK_SKEW_S), and `redis_key` is its own."""
    envelope = bounded_json.loads(value, MAX_RECORD_BYTES, MAX_RECORD_DEPTH)
    if not isinstance(envelope, dict) or not isinstance(envelope.get("record"), dict):
        raise ValueError("not a signed record")
    body, presented = envelope["record"], str(envelope.get("signature", ""))
    if not hmac.compare_digest(presented.encode(), _signature(key, body).encode()):
        raise UntrustedRecord("its signature does not verify under our cluster token")
    signed_at = float(body.get("signed_at", 0.0))
    age = now - signed_at
    if not -MAX_CLOCK_SKEW_S <= age <= max_age_s + MAX_CLOCK_SKEW_S:
        raise UntrustedRecord(f"it was signed {age:.1f} s ago, outside its TTL")
    record = WorkerRecord.from_dict(body)
    if worker_key(record.worker_id) != (
        redis_key.decode() if isinstance(redis_key, bytes) else redis_key
    ):
        raise UntrustedRecord(f"it names worker {record.worker_id!r}, not its key's")
    return record


def worker_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


def _client(redis_url: str, ttl_s: float, single_connection: bool = False) -> aioredis.Redis:
    # Socket timeouts bound every command: a hung Redis must not hang a heartbeat or a refresh.
    timeout = max(0.5, ttl_s / 3)
    return aioredis.Redis.from_url(
        redis_url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        single_connection_client=single_connection,
        # A tracking connection speaks RESP2 like its listener: Redis writes a flush's message
        # in the tracking connection's protocol, which a RESP2 listener could not parse.
        protocol=2 if single_connection else None,
    )


class WorkerRegistration:
    """Keeps one worker's record in Redis while it runs.

    `load_fn` is called on every beat for the current load; `token` (the cluster token) signs
    each write.

    Besides the periodic beat, the worker writes its record again the moment the record
    vanishes (a FLUSHALL, a DEL, a restarted Redis), so routers never miss it for a beat: the
    beating connection asks Redis to tell a second, listening one whenever the key changes
    (client-side caching's broadcast tracking, Redis >= 6, on the key alone and ignoring its own
    writes); a flush or a change by anyone else wakes the listener, and a Redis restart closes
    its connection; either way the record is written at once.
    """

    def __init__(
        self,
        redis_url: str,
        record: WorkerRecord,
        load_fn: Callable[[], Load],
        token: str,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.record = record
        self._token = token
        self._redis_url = redis_url
        self._load_fn = load_fn
        self._ttl_s = ttl_s
        self._redis: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> bool:
        """Write the record, then heartbeat; returns whether the first write landed.

        A worker that starts while Redis is down still serves: the router keeps the workers it
        saw through an outage, so a worker restarted at the same address takes requests again at
        once, and the heartbeat registers it when Redis is back."""
        # One connection: tracking belongs to the connection that asked for it, and NOLOOP
        # (ignore our own writes) only covers writes on that same connection.
        self._redis = _client(self._redis_url, self._ttl_s, single_connection=True)
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
        wid = self.record.worker_id
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name=f"registry-heartbeat-{wid}"),
            asyncio.create_task(self._watch_key(), name=f"registry-key-watch-{wid}"),
        ]
        return registered

    async def stop(self) -> None:
        """Stop beating and delete the key, so the router stops routing here at once."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
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
        value = seal(self.record, self._token, time.time())
        await self._redis.set(worker_key(self.record.worker_id), value, px=ttl_ms)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._beat()
            except (aioredis.RedisError, OSError) as e:
                # Keep beating: a short Redis outage must not take a healthy worker out for good.
                log.warning("registry heartbeat for %s failed: %s", self.record.worker_id, e)

    async def _watch_key(self) -> None:
        """Write the record again whenever Redis says the key changed, or the listening
        connection is new (first start, or Redis came back: it may have lost every key)."""
        while True:
            try:
                await self._listen()
            except (aioredis.RedisError, OSError) as e:
                # (debug: while Redis is down the heartbeat already warns at every beat)
                log.debug("registry key watch for %s: %s; reconnecting", self.record.worker_id, e)
            await asyncio.sleep(KEY_WATCH_RETRY_S)  # (Redis down: retry, not spin)

    async def _listen(self) -> None:
        assert self._redis is not None
        key = worker_key(self.record.worker_id)
        # No socket timeout: the listener waits for as long as nothing happens; a Redis that
        # goes away closes the connection (and the heartbeat still writes every TTL/3).
        # RESP2: the invalidations arrive as plain pub/sub replies that read_response returns.
        pool = aioredis.ConnectionPool.from_url(
            self._redis_url,
            protocol=2,
            socket_timeout=None,
            socket_connect_timeout=max(0.5, self._ttl_s / 3),
        )
        listener = await pool.get_connection()
        try:
            await listener.send_command("CLIENT", "ID")
            listener_id = int(await listener.read_response())
            await listener.send_command("SUBSCRIBE", INVALIDATE_CHANNEL)
            await listener.read_response()  # the subscription's confirmation
            # (off first: the connection may still track for a listener that is gone)
            await self._redis.client_tracking_off()
            await self._redis.client_tracking_on(
                clientid=listener_id, prefix=[key], bcast=True, noloop=True
            )
            while True:
                # A key that tracking now covers may have been lost before (a restarted Redis,
                # a flush while we were away): write it now, then after every change.
                await self._beat()
                while not await self._lost(await listener.read_response(), key):
                    pass
                log.warning(
                    "registry record of %s vanished; writing it again", self.record.worker_id
                )
        finally:
            await pool.disconnect()

    async def _lost(self, message: object, key: str) -> bool:
        """Whether an invalidation means our record may be gone: a flush (no key names), or
        a change to our key by someone else (a DEL, an expiry); then only if it is gone."""
        if not isinstance(message, list) or len(message) < 3 or message[0] != b"message":
            return False
        keys = message[2]
        if keys is not None and key.encode() not in keys:
            return False
        assert self._redis is not None
        return not await self._redis.exists(key)


class RegistryWatcher:
    """An in-memory snapshot of the live workers, refreshed every TTL/2.

    A worker leaves the snapshot only when a successful refresh no longer finds it: it
    deregistered, or its TTL expired. A failed refresh changes nothing. Nor does a worker's
    absence in the first TTL after Redis comes back: live workers may not have beaten since
    (a restarted Redis starts empty, a paused one expires every key when it resumes), so the
    snapshot keeps what it had until each of them had a TTL to write its record again. The same
    holds after Redis lost its keys between two refreshes (a FLUSHALL, a restart): the watcher
    knows by a marker key of its own that is gone, and the workers write again within TTL/3.

    Only records that `unseal` under `token` enter the snapshot; `untrusted` counts the others
    of the last refresh (a router given another --cluster-token than its workers sees only those).
    """

    def __init__(self, redis_url: str, token: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._redis_url = redis_url
        self._token = token
        self.untrusted = 0
        self._untrusted_keys: set[str] = set()  # logged once each, not at every refresh
        self._ttl_s = ttl_s
        self._redis: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._snapshot: list[WorkerRecord] = []
        self._up = False  # did the last refresh reach Redis?
        self._refreshed_at = 0.0  # monotonic time of the last successful refresh
        self._keep_until = 0.0  # monotonic time until which absent workers are kept
        self._marker = MARKER_PREFIX + uuid.uuid4().hex  # this watcher's own key (see _read)
        self.restarts = 0  # times the watch loop started over after an unexpected error
        self.last_error: str | None = None  # the latest of those errors

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
            records, lost = await self._read()
        except BaseException:
            self._up = False
            raise
        now = time.monotonic()
        fresh = {w.worker_id: w for w in records}
        back = not self._up and self._refreshed_at
        if back or (lost and self._refreshed_at):  # keep them while they write their records
            self._keep_until = now + self._ttl_s
        self._up = True
        if now < self._keep_until:
            for worker in self._snapshot:  # may not have beaten since Redis came back: keep it
                fresh.setdefault(worker.worker_id, worker)
        self._snapshot = sorted(fresh.values(), key=lambda w: w.worker_id)
        self._refreshed_at = now

    async def _read(self) -> tuple[list[WorkerRecord], bool]:
        """The trusted records, and whether Redis lost its keys since the last read: the
        watcher's marker key, rewritten at every read, is gone (a FLUSHALL, a restart)."""
        assert self._redis is not None, "start() the watcher first"
        ttl_ms = max(1, round(MARKER_TTLS * self._ttl_s * 1000))
        lost = await self._redis.set(self._marker, b"1", px=ttl_ms, get=True) is None
        keys = [key async for key in self._redis.scan_iter(match=KEY_PREFIX + "*", count=1000)]
        untrusted: dict[str, str] = {}  # key -> why
        if keys:  # (sizes first: a huge value is never fetched into this process)
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.strlen(key)
                sizes = await pipe.execute(raise_on_error=False)
            for key, size in zip(keys, sizes, strict=True):
                if not isinstance(size, int) or size > MAX_RECORD_BYTES:
                    untrusted[key] = f"not a string of at most {MAX_RECORD_BYTES} bytes"
            keys = [key for key in keys if key not in untrusted]
        values = await self._redis.mget(keys) if keys else []
        records, now = [], time.time()
        for key, value in zip(keys, values, strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                records.append(unseal(key, value, self._token, now, self._ttl_s))
            except Exception as e:  # (whatever is wrong with one value, the others count)
                untrusted[key] = str(e)
        for key, why in untrusted.items():
            if key not in self._untrusted_keys:
                log.warning("ignoring registry entry %r: %s", key, why)
        self.untrusted, self._untrusted_keys = len(untrusted), set(untrusted)
        return records, lost

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
            except Exception as e:  # a bug or a reply we cannot read: start over, keep routing
                await self._restart(e)
                continue
            if not was_up:
                log.warning("registry reachable again; %d workers", len(self._snapshot))

    async def _restart(self, error: Exception) -> None:
        """Start the watch over with a new connection after an unexpected error; the snapshot
        stays, as through an outage."""
        self.restarts += 1
        self.last_error = f"{type(error).__name__}: {error}"
        log.exception("registry watcher failed; restarting it (restart %d)", self.restarts)
        old, self._redis = self._redis, _client(self._redis_url, self._ttl_s)
        if old is not None:
            with contextlib.suppress(Exception):  # (the old connection may be what broke)
                await old.aclose()
