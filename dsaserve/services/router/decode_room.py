"""Prefill admission bounded by decode capacity: no prompt is computed whose KV no decode worker
could take.

Decode reserves a request's pages only after its prefill is done; when every decode worker is
full, a prefill worker computes KV that waits out its lease and is thrown away (the decode
worker refuses it: "no free KV pages before the prefill lease ran out"), while the prompts
behind it wait for nothing. So, as Dynamo's frontend sheds load by its decode workers' KV block
use (`--active-decode-blocks-threshold`) and SGLang's prefill waits for the decode side's
pre-allocation, the router holds a prompt back until a decode worker has room for it:

    room  <=>  used + (in transit + 1) * per request  <=  threshold * total

over the decode workers of the model, pooled (the decode worker is picked after the prefill):
`used` is their pages neither free nor only cached (registry records), `per request` the pages
a running request holds there on average, and `in transit` this router's requests sent to
prefill whose decode stream has not started yet (no record shows their pages; without this
term a burst between two heartbeats would all pass; after it, the decode worker's next record
does, up to a heartbeat and a refresh later, which the threshold's headroom covers). Unknown
costs (no request running) count as zero: an idle decode side has room. A prompt held back
longer than `max_wait_s` (--max-queue-delay) is refused with 503 + Retry-After; it keeps its
admission slot meanwhile, so newcomers queue, and are refused, at admission.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from dsaserve.services.registry import WorkerRecord
from dsaserve.services.router.api.errors import APIError

RECHECK_S = 0.25  # a held prompt looks again this often (registry records change meanwhile)


class DecodeRoom:
    def __init__(
        self,
        decode_workers: Callable[[], Sequence[WorkerRecord]],
        threshold: float,
        max_wait_s: float,
        retry_after_s: int,
    ) -> None:
        """decode_workers: the live decode workers of the model; threshold: the fraction of
        their KV pages that may be spoken for (1.0: all of them)."""
        self._decode_workers = decode_workers
        self.threshold = threshold
        self._max_wait_s = max_wait_s
        self._retry_after_s = retry_after_s
        self.in_transit = 0
        self.waiting = 0
        self._left = asyncio.Event()  # set (and replaced) whenever a request leaves transit

    def has_room(self) -> bool:
        workers = self._decode_workers()
        total = sum(w.load.total_pages for w in workers)
        if not workers or not total:  # (no decode worker: selection says so with its own 503)
            return True
        used = sum(w.load.total_pages - w.load.free_pages - w.load.cached_pages for w in workers)
        running = sum(w.load.running for w in workers)
        per_request = used / running if running else 0.0
        return used + (self.in_transit + 1) * per_request <= self.threshold * total

    async def enter(self, timeout_s: float) -> Transit:
        """Wait for room (at most `timeout_s` and `max_wait_s`), then count one request in
        transit until the `Transit` is left; 503 + Retry-After when no room came."""
        wait_s = min(timeout_s, self._max_wait_s)
        if not self.has_room():
            self.waiting += 1
            try:
                async with asyncio.timeout(wait_s):
                    while not self.has_room():
                        left = self._left
                        try:
                            async with asyncio.timeout(RECHECK_S):
                                await left.wait()
                        except TimeoutError:
                            pass
            except TimeoutError:
                raise APIError(
                    503,
                    f"Every decode worker's KV cache is full (above {self.threshold:.0%} with "
                    f"the requests on their way to it) and stayed so for {wait_s:.3g} s; retry "
                    "later.",
                    code="decode_full",
                    cause="decode_full",
                    retry_after_s=max(1, math.ceil(self._retry_after_s)),
                ) from None
            finally:
                self.waiting -= 1
        self.in_transit += 1
        return Transit(self)

    def _leave(self) -> None:
        self.in_transit -= 1
        self._left.set()
        self._left = asyncio.Event()


class Transit:
    """One request between its prefill's start and its decode worker's reservation."""

    def __init__(self, room: DecodeRoom) -> None:
        self._room: DecodeRoom | None = room

    def leave(self) -> None:
        """The decode worker holds the request's pages now (or never will); idempotent."""
        if self._room is not None:
            self._room._leave()
            self._room = None
