"""Continuous batching: which requests compute which tokens in the next forward step.

Every step first gives each running request that is decoding its one token, then
continues chunked prefills and admits waiting requests under the per-step token budget.
A request is admitted only when the pools can hold all its known tokens, so a prefill
never stalls half way; a decode that needs a new page while the pools are full preempts
the most recently admitted request (its KV is freed and recomputed later), so the pool
filling up queues work instead of failing it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv.allocator import OutOfPages
from engine.kv.pool import KVPool
from engine.request import Request, Status


@dataclass
class ScheduledBatch:
    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, rows this step)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, pool: KVPool, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request holding a place here, by id
        self.num_held = 0  # requests in status HELD
        self.num_preemptions = 0

    # ---------------------------------------------------------------- lifecycle

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def reserve(self, req: Request) -> bool:
        """Give `req` pages for its prompt without scheduling it (a transfer will fill them)."""
        if not self.try_allocate(req, req.num_tokens - 1):
            return False
        req.status = Status.RESERVED
        self.requests[req.request_id] = req
        return True

    def join(self, req: Request) -> None:
        """A reserved request whose KV has arrived starts decoding."""
        assert req.status is Status.RESERVED
        req.status = Status.RUNNING
        self.running.append(req)

    def hold(self, req: Request) -> None:
        """A prefill-only request keeps its KV after its first token until released or until
        its lease deadline (set by the engine once the token is on the host)."""
        self.running.remove(req)
        req.status = Status.HELD
        self.num_held += 1

    def finish(self, req: Request, reason: str) -> None:
        """End `req` and free everything it holds (waiting, reserved, running or held)."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.HELD:
            self.num_held -= 1
        self.free_kv(req)
        self.requests.pop(req.request_id, None)
        req.status, req.finish_reason = Status.FINISHED, reason

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.token_budget
        for req in [r for r in self.running if _is_decoding(r) and not r.ends_in_flight]:
            if budget == 0:
                break
            # An earlier request may have preempted this one to make room for itself.
            if req.status is Status.RUNNING and self._grow_or_preempt(req):
                batch.decode.append(req)
                budget -= 1
        for req in self.running:
            if budget and not _is_decoding(req):
                n = min(req.num_pending, budget)
                batch.prefill.append((req, n))
                budget -= n
        while budget and self.waiting:
            req = self.waiting[0]
            # FIFO: later requests wait too, so a big one is not starved; a preempted request
            # whose newest token is still on the device is recomputed once the token is known
            if req.num_inflight or not self.try_allocate(req, req.num_tokens):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_pending, budget)
            batch.prefill.append((req, n))
            budget -= n
        return batch

    def _grow_or_preempt(self, req: Request) -> bool:
        """Make room for one more token of `req`; False if `req` itself had to be preempted."""
        while not self.try_allocate(req, req.num_computed + 1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Free req's KV and queue it first; its tokens so far are recomputed on re-admission."""
        self.running.remove(req)
        self.free_kv(req)
        self.num_preemptions += 1
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- KV pages

    def try_allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow req's page tables (and give it a slab row) to cover `num_tokens` tokens."""
        pool = self.pool
        need = {
            g: pool.pages_for(g, num_tokens) - len(req.page_tables.get(g, [])) for g in pool.groups
        }
        if any(n > pool.groups[g].allocator.num_free for g, n in need.items()):
            return False
        if req.slab is None:
            try:
                req.slab = pool.slab.allocate(1)[0]
            except OutOfPages:
                return False
        for g, n in need.items():
            if n > 0:
                pages = pool.groups[g].allocator.allocate(n)
                table = req.page_tables.setdefault(g, [])
                pool.write_page_table(req.slab, g, len(table), pages)
                table.extend(pages)
        return True

    def free_kv(self, req: Request) -> None:
        for g, pages in req.page_tables.items():
            self.pool.groups[g].allocator.free(pages)
        req.page_tables = {}
        if req.slab is not None:
            self.pool.slab.free([req.slab])
            req.slab = None


def _is_decoding(req: Request) -> bool:
    return req.num_computed > 0 and req.num_pending == 1
