"""Admission control: at most `max_inflight` requests run, up to `max_queue` wait, the rest get 429.

Bounding the router's concurrency is backpressure for the whole cluster: a burst queues here,
in one visible gauge, instead of piling up as gRPC calls that workers cannot take.
"""

from __future__ import annotations

import asyncio

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
