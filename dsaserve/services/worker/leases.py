"""A worker's lease table: whose held KV a reader may still read, decided at once (a prefill
worker's held prompts, a decode worker's loans: services.worker.pull).

Claim, Release and Abort are answered here, on the worker's event loop, never behind an engine
step: a slow step (a long prompt, a loaded machine) once made a reader's Claim miss its deadline
and a request whose KV was ready was thrown away. The engine frees what the table gave up at
its next command drain (`EngineLoop.call`, not awaited). Freeing later than decided is always
safe, and Release's `intact` stays sound: a request's pages are freed only after the table
dropped it (released, aborted, expired), and a dropped request is never claimed or released
intact again.

The table lives on one event loop and is never touched from another thread: no lock.
"""

from __future__ import annotations


class LeaseTable:
    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}  # request id -> monotonic end of its lease

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadlines

    def hold(self, request_id: str, deadline: float) -> None:
        """The request's KV is held for a reader until `deadline` (time.monotonic())."""
        self._deadlines[request_id] = deadline

    def claim(self, request_id: str, hold_s: float, now: float) -> float | None:
        """Keep the KV until at least `now + hold_s`: the new deadline, or None when it is no
        longer held (never was, dropped, or its lease ended before `now`: then the caller
        frees it, as `expire` would)."""
        deadline = self._deadlines.get(request_id)
        if deadline is None:
            return None
        if deadline < now:
            del self._deadlines[request_id]
            return None
        self._deadlines[request_id] = max(deadline, now + hold_s)
        return self._deadlines[request_id]

    def drop(self, request_id: str, now: float) -> bool:
        """Stop holding the KV (released or aborted); True if it was held until `now`."""
        deadline = self._deadlines.pop(request_id, None)
        return deadline is not None and deadline >= now

    def expire(self, now: float) -> list[str]:
        """Drop every lease that ended before `now`; their request ids."""
        expired = [rid for rid, deadline in self._deadlines.items() if deadline < now]
        for rid in expired:
            del self._deadlines[rid]
        return expired
