"""Admission control: at most `max_inflight` requests run, up to `max_queue` wait, the rest get 429;
and no API key holds more than `max_inflight_per_key` of those at once.

Bounding the router's concurrency is backpressure for the whole cluster: a burst queues here,
in one visible gauge, instead of piling up as gRPC calls that workers cannot take. The per-key
bound keeps one client from filling the queue that every client shares. Under overload the
queue would grow until requests wait longer than their clients do; so a request waits at most
`max_queue_delay_s` (503 + Retry-After after it), and while the oldest waiter has waited half
that long already a newcomer, which would likely wait out the rest, gets its 429 at once:
refused early, never left to hang.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time

from dsaserve.services.router.api.errors import APIError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, max_queue_delay_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.max_queue_delay_s = max_queue_delay_s
        self.inflight = 0
        self._slots = asyncio.Semaphore(max_inflight)
        self._since: dict[int, float] = {}  # waiter -> when it began waiting, oldest first
        self._ids = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._since)

    def refuse_if_full(self, now: float) -> None:
        """The 429 a newcomer gets at once: every slot taken and the queue full, or its oldest
        waiter already waited half the queue delay. Also asked before a request is rendered and
        tokenized, so a refusal costs the router (which shares the machine) next to nothing."""
        oldest = next(iter(self._since.values()), now)
        if self._slots.locked() and (
            self.waiting >= self.max_queue or now - oldest >= self.max_queue_delay_s / 2
        ):
            raise APIError(
                429,
                f"The server is at capacity ({self.inflight} requests running, "
                f"{self.waiting} queued); retry later.",
                code="queue_full",
                cause="queue_full",
            )

    async def acquire(self, timeout_s: float) -> None:
        """Take a slot, waiting in FIFO order at most `timeout_s` (and `max_queue_delay_s`);
        pair with `release()`."""
        now = time.monotonic()
        self.refuse_if_full(now)
        waiter = next(self._ids)
        self._since[waiter] = now
        wait_s = min(timeout_s, self.max_queue_delay_s)
        try:
            await asyncio.wait_for(self._slots.acquire(), wait_s)
        except TimeoutError:
            if wait_s < timeout_s:
                raise APIError(
                    503,
                    f"The request waited {wait_s:.3g} s for admission behind {self.inflight} "
                    "running requests (--max-queue-delay); retry later.",
                    code="queue_timeout",
                    cause="queue_timeout",
                ) from None
            raise APIError(
                504,
                f"The request timed out after waiting {timeout_s:.3g} s for admission behind "
                f"{self.inflight} running requests; retry later.",
                cause="timeout",
            ) from None
        finally:
            del self._since[waiter]
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self._slots.release()


class KeyLimit:
    """At most `limit` requests per API key at once (0: no limit); over it, a 429 at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: collections.Counter[str] = collections.Counter()

    def acquire(self, key: str | None) -> None:
        """Count one request of `key` (None: no key, not limited); pair with `release(key)`."""
        if not self.limit or key is None:
            return
        if self._open[key] >= self.limit:
            raise APIError(
                429,
                f"This API key already has {self._open[key]} requests in flight, the most the "
                "router allows one key (--max-inflight-per-key); retry when one finishes.",
                code="too_many_requests_per_key",
                cause="key_limit",
            )
        self._open[key] += 1

    def release(self, key: str | None) -> None:
        if not self.limit or key is None:
            return
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]  # keys come and go; counts at 0 must not pile up
