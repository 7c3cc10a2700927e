"""Admission control: at most `max_inflight` requests run, up to `max_queue` wait, the rest get 429;
and no API key holds more than `max_inflight_per_key` of those at once.

Bounding the router's concurrency is backpressure for the whole cluster: a burst queues here,
in one visible gauge, instead of piling up as gRPC calls that workers cannot take. The per-key
bound keeps one client from filling the queue that every client shares.
"""

from __future__ import annotations

import asyncio
import collections

from .errors import APIError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.inflight = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_inflight)

    async def acquire(self, timeout_s: float) -> None:
        """Take a slot, waiting in FIFO order at most `timeout_s`; pair with `release()`."""
        if self._slots.locked() and self.waiting >= self.max_queue:
            raise APIError(
                429,
                f"The server is at capacity ({self.inflight} requests running, "
                f"{self.waiting} queued); retry later.",
                code="queue_full",
                cause="queue_full",
            )
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except TimeoutError:
            raise APIError(
                504,
                f"The request timed out after waiting {timeout_s:.3g} s for admission behind "
                f"{self.inflight} running requests; retry later.",
                cause="timeout",
            ) from None
        finally:
            self.waiting -= 1
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
