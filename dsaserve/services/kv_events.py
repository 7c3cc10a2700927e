"""Which prefixes each worker's cache holds: the worker publishes, the router indexes.

A worker's prefix cache is a tree of token blocks, each named by a chained hash
(engine.prefix_cache.block_hash). The worker appends what changes to a Redis stream of its own,
`dsaserve:kv-events:<worker_id>` (`CacheEventPublisher`): the blocks made and dropped since the
last entry, every PUBLISH_S at most; a whole snapshot ("reset") at start, every RESET_S, and after
any entry that could not be written; an empty entry every KEEPALIVE_S when nothing changes. Each
entry carries the worker's incarnation (a new one each process start) and a sequence number, and
every reset the hashing parameters (salt, block size), so a reader can tell a gap from silence.

The router (`CacheIndex`) reads the streams of the live workers (both roles) with one blocking
XREAD: a worker it has not met yet is read from its latest reset on; an entry that does not
follow the one before it (a gap: entries trimmed away, a Redis outage) leaves that worker
unknown until its next reset. A worker that is unknown, or whose last entry is older than
STALE_S, matches nothing: routing falls back to load balancing, never to an error. Between a
request and the entry that reports its blocks the router remembers where it sent them
(ROUTED_S), so the next turn of a conversation finds its worker even before the worker has said
so. A decode worker's stream holds the conversations it decoded (engine.prefix_cache.cache's
`keep`): the router sends a next turn to that decode worker while it has room (the policy's
`room`), and its prefill worker borrows the last answer's state from it (engine.loans).

Why a stream per worker rather than the Load/Describe RPCs or the registry record: changes reach
every router within PUBLISH_S whatever their number, with no call per worker on the request path;
a stream is ordered and numbered, so a missed change is detected instead of silently wrong; and
the registry record, rewritten every heartbeat, stays small (a full set of hashes in it would be
sent whole every beat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from dsaserve.engine.prefix_cache.block_hash import DIGEST_BYTES, block_hashes, salted

log = logging.getLogger(__name__)

STREAM_PREFIX = "dsaserve:kv-events:"
MAXLEN = 1000  # entries a stream keeps (approximately): a router further behind waits for a reset
STREAM_TTL_S = 60.0  # a dead worker's stream goes away on its own
PUBLISH_S = 0.1
KEEPALIVE_S = 2.0
RESET_S = 30.0
STALE_S = 10.0  # a worker heard from longer ago matches nothing
ROUTED_S = 30.0  # how long the router trusts its own record of where it sent a prompt
READ_BLOCK_MS = 500


Fields = dict[bytes, bytes]  # a stream entry as read
Entries = list[tuple[bytes, Fields]]  # (entry id, fields), in stream order


def stream_key(worker_id: str) -> str:
    return STREAM_PREFIX + worker_id


def _pack(hashes: Sequence[bytes]) -> bytes:
    return b"".join(hashes)


def _unpack(data: bytes) -> list[bytes]:
    return [data[i : i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)]


@dataclass(frozen=True)
class CacheEvent:
    """One stream entry: blocks stored and removed since the entry `seq - 1` of `incarnation`; a
    reset replaces everything with `stored` and names the hashing parameters."""

    incarnation: str
    seq: int
    reset: bool
    stored: list[bytes]
    removed: list[bytes] = field(default_factory=list)
    salt: bytes = b""
    block: int = 0

    def fields(self) -> dict[FieldT, EncodableT]:
        out: dict[FieldT, EncodableT] = {
            b"inc": self.incarnation.encode(),
            b"seq": str(self.seq).encode(),
            b"reset": b"1" if self.reset else b"0",
            b"stored": _pack(self.stored),
            b"removed": _pack(self.removed),
        }
        if self.reset:
            out[b"salt"], out[b"block"] = self.salt, str(self.block).encode()
        return out

    @classmethod
    def parse(cls, data: Fields) -> CacheEvent:
        """An entry as written by `fields`; ValueError if it is not one."""
        try:
            reset = data[b"reset"] == b"1"
            return cls(
                incarnation=data[b"inc"].decode(),
                seq=int(data[b"seq"]),
                reset=reset,
                stored=_unpack(data[b"stored"]),
                removed=_unpack(data[b"removed"]),
                salt=data[b"salt"] if reset else b"",
                block=int(data[b"block"]) if reset else 0,
            )
        except (KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"not a cache event: {e!r}") from None


# (held hashes if asked for a snapshot, else None; (hash, stored?) changes since the last call)
Drain = Callable[[bool], Awaitable[tuple[list[bytes] | None, list[tuple[bytes, bool]]]]]


class _RedisTask:
    """A Redis client and the task that uses it, started and stopped together."""

    def __init__(self, redis: aioredis.Redis, name: str) -> None:
        self._redis, self._name = redis, name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()

    async def _run(self) -> None:
        raise NotImplementedError


class CacheEventPublisher(_RedisTask):
    """A worker's side: its cache's changes into its stream while it runs."""

    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        incarnation: str,
        salt: bytes,
        block: int,
        drain: Drain,
    ) -> None:
        """drain(snapshot): the engine's PrefixCache.take_events, run on its thread."""
        redis = aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self._key = stream_key(worker_id)
        super().__init__(redis, f"kv-events-{self._key}")
        self._incarnation, self._salt, self._block, self._drain = incarnation, salt, block, drain
        self._seq = 0

    async def _run(self) -> None:
        reset_due = sent = 0.0  # monotonic times: next reset, last entry written
        while True:
            now = time.monotonic()
            full = now >= reset_due
            held, changes = await self._drain(full)
            if full or changes or now - sent >= KEEPALIVE_S:
                self._seq += 1
                event = CacheEvent(
                    self._incarnation,
                    self._seq,
                    reset=held is not None,
                    stored=held if held is not None else [h for h, s in changes if s],
                    removed=[] if held is not None else [h for h, s in changes if not s],
                    salt=self._salt,
                    block=self._block,
                )
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        pipe.xadd(self._key, event.fields(), maxlen=MAXLEN, approximate=True)
                        pipe.expire(self._key, int(STREAM_TTL_S))
                        await pipe.execute()
                    sent = now
                    reset_due = now + RESET_S if full else reset_due
                except (aioredis.RedisError, OSError) as e:
                    # what this entry said is lost: readers must start over from a reset
                    log.warning("could not publish prefix-cache changes (%s); resetting next", e)
                    reset_due = now
            await asyncio.sleep(PUBLISH_S)


@dataclass
class _Worker:
    """What the router knows of one worker's cache."""

    last_id: bytes = b"0"  # the stream entry read last
    incarnation: str = ""
    seq: int = 0
    in_sync: bool = False  # applied a reset and every entry since
    salt: bytes = b""
    block: int = 0
    hashes: set[bytes] = field(default_factory=set)
    heard_at: float = 0.0  # monotonic time of its last entry
    routed: dict[bytes, float] = field(default_factory=dict)  # hash -> until when sent there

    def apply(self, event: CacheEvent) -> None:
        if event.reset:
            self.incarnation, self.seq, self.in_sync = event.incarnation, event.seq, True
            self.salt, self.block, self.hashes = event.salt, event.block, set(event.stored)
            return
        if not self.in_sync or event.incarnation != self.incarnation or event.seq != self.seq + 1:
            self.in_sync = False  # a gap: wait for the next reset
            return
        self.seq = event.seq
        self.hashes.difference_update(event.removed)
        self.hashes.update(event.stored)


class CacheIndex(_RedisTask):
    """The router's side: what each live worker's cache holds, by block hash."""

    def __init__(self, redis_url: str, workers: Callable[[], list[str]]) -> None:
        """workers(): the ids of the workers to follow (the registry's live ones)."""
        timeout = READ_BLOCK_MS / 1000 + 2
        redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout, socket_connect_timeout=2)
        super().__init__(redis, "kv-events-index")
        self._worker_ids = workers
        self._workers: dict[str, _Worker] = {}

    # ---------------------------------------------------------------- routing

    def matched_tokens(
        self,
        worker_ids: Sequence[str],
        prompt: Sequence[int],
        cache_salt: str | None = None,
        routed: bool = True,
    ) -> dict[str, int]:
        """Per worker, the tokens of `prompt` its cache holds as far as known (whole blocks from
        the start) in the namespace of `cache_salt`, as the worker hashes them (block_hash.
        salted; `routed`: counting what was sent there lately, not only what the worker said it
        holds); 0 for a worker unknown, out of sync or silent for STALE_S."""
        now, out = time.monotonic(), {}
        hashes: dict[tuple[bytes, int], list[bytes]] = {}  # by hashing parameters
        for worker_id in worker_ids:
            w = self._workers.get(worker_id)
            out[worker_id] = 0
            if w is None or not w.in_sync or now - w.heard_at > STALE_S or not w.block:
                continue
            params = (w.salt, w.block)
            if params not in hashes:
                hashes[params] = block_hashes(prompt, salted(w.salt, cache_salt), w.block)
            for h in hashes[params]:
                if h not in w.hashes and (not routed or w.routed.get(h, 0.0) < now):
                    break
                out[worker_id] += w.block
        return out

    def routed(self, worker_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> None:
        """`prompt` (in `cache_salt`'s namespace) was just sent to `worker_id`: its blocks
        count as held there for a while."""
        w = self._workers.get(worker_id)
        if w is None or not w.block:
            return
        until = time.monotonic() + ROUTED_S
        for h in block_hashes(prompt, salted(w.salt, cache_salt), w.block):
            w.routed[h] = until

    # ---------------------------------------------------------------- reading

    async def _run(self) -> None:
        while True:
            try:
                await self._read()
            except (aioredis.RedisError, OSError) as e:
                log.warning("prefix-cache events unreadable (%s); routing by load meanwhile", e)
                for w in self._workers.values():
                    w.in_sync = False  # whatever happened meanwhile went unseen
                await asyncio.sleep(1.0)

    async def _read(self) -> None:
        live = set(self._worker_ids())
        for gone in set(self._workers) - live:
            del self._workers[gone]
        for new in live - set(self._workers):
            self._workers[new] = await self._bootstrap(new)
        if not self._workers:
            await asyncio.sleep(READ_BLOCK_MS / 1000)
            return
        streams: dict[KeyT, StreamIdT] = {
            stream_key(i): w.last_id for i, w in self._workers.items()
        }
        read = await self._redis.xread(streams, block=READ_BLOCK_MS)
        for key, entries in cast(list[tuple[bytes, Entries]], read or []):
            w = self._workers.get(key.decode().removeprefix(STREAM_PREFIX))
            if w is not None:
                self._apply(w, entries)
        now = time.monotonic()
        for w in self._workers.values():
            w.routed = {h: t for h, t in w.routed.items() if t > now}

    async def _bootstrap(self, worker_id: str) -> _Worker:
        """Read a newly seen worker's stream from its latest reset."""
        w = _Worker()
        newest_first = await self._redis.xrevrange(stream_key(worker_id), count=MAXLEN + 100)
        entries = cast(Entries, newest_first or [])
        for i, (entry_id, data) in enumerate(entries):
            w.last_id = w.last_id if i else entry_id
            if data.get(b"reset") == b"1":
                self._apply(w, entries[i::-1])
                break
        return w

    @staticmethod
    def _apply(w: _Worker, entries: Entries) -> None:
        for entry_id, data in entries:
            w.last_id = entry_id
            try:
                w.apply(CacheEvent.parse(data))
            except ValueError as e:
                log.warning("ignoring a malformed prefix-cache event: %s", e)
                w.in_sync = False
                continue
            w.heard_at = time.monotonic()
