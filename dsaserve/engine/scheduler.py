"""Continuous batching: which requests compute which tokens in the next forward step.

Every step first gives each running request that is decoding its one token, then
continues chunked prefills and admits waiting requests under the per-step token budget.
A request is admitted only when the pools can hold all its known tokens, so a prefill
never stalls half way; a decode that needs a new page while the pools are full preempts
the most recently admitted request (its KV is freed and recomputed later), so the pool
filling up queues work instead of failing it.

With a prefix cache (engine.prefix_cache.cache) a request is admitted at the deepest checkpoint it
shares (or waits a step for one the current step computes), its prefill chunks leave
checkpoints behind, and pages only the cache holds are evicted before anything waits or is
preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsaserve.engine.kv.allocator import OutOfPages
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.prefix_cache.cache import Hit, PrefixCache
from dsaserve.engine.prefix_cache.checkpoint import Capture, CopyPlan
from dsaserve.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    decode: list[Request] = field(default_factory=list)
    # speculative decoding: decoding requests that verify their drafts (1 + drafts rows each)
    verify: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, rows this step)
    copies: CopyPlan = field(default_factory=CopyPlan)  # pages to copy before the step
    captures: dict[str, tuple[Capture, ...]] = field(default_factory=dict)  # request id ->
    # request id -> RowSpan.anchors of its chunk (a family with a prefill halo only)
    anchors: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.decode or self.verify or self.prefill)


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        max_num_batched_tokens: int,
        cache: PrefixCache | None = None,
        draft_tokens: int = 0,
    ) -> None:
        """draft_tokens: positions past a request's newest token and its drafts that speculative
        decoding writes (the MTP layer's passes: K; DSpark's block writes only scratch rows: 0),
        so its pages cover them."""
        self.pool, self.cache = pool, cache
        self.draft_tokens = draft_tokens
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

    def reserve(self, req: Request, hit: Hit | None = None, need: int | None = None) -> int | None:
        """Give `req` pages for `need` tokens (default: its prompt) without scheduling it (a
        transfer will fill them), sharing the full entry pages of the prefix `hit` names where
        it can. Returns the tokens whose pages it shares (the transfer fills the rest:
        KVPool.missing), None when the pools are full."""
        need = req.num_tokens - 1 if need is None else need
        if hit is not None and self._share(req, hit, need):
            shared = hit.position
        elif self.try_allocate(req, need):
            shared = 0
        else:
            return None
        req.status = Status.RESERVED
        self.requests[req.request_id] = req
        return shared

    def lend(self, req: Request, hit: Hit, copies: CopyPlan) -> bool:
        """Hold `req` for a reader with the state of its cached prefix `hit`, restored into
        pages of its own (the copies planned); False without room."""
        if not self._share(req, hit, hit.position):
            return False
        assert self.cache is not None
        self.cache.restore(req, hit, copies)
        req.status = Status.HELD
        self.requests[req.request_id] = req
        self.num_held += 1
        return True

    def join(self, req: Request) -> None:
        """A reserved request whose KV has arrived starts decoding (or, its prompt not all
        there, computing the rest of it)."""
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
        if self.cache is not None:
            batch.copies = self.cache.begin_step()
        for req in [r for r in self.running if _is_decoding(r) and not r.ends_in_flight]:
            if budget == 0:
                break
            # (drafts that do not fit the step's budget are dropped)
            del req.draft_token_ids[budget - 1 :]
            # An earlier request may have preempted this one to make room for itself.
            if req.status is Status.RUNNING and self._grow_or_preempt(req):
                (batch.verify if req.draft_token_ids else batch.decode).append(req)
                budget -= 1 + len(req.draft_token_ids)
        for req in self.running:
            if budget and not _is_decoding(req):
                budget -= self._prefill(batch, req, budget)
        at = 0
        while budget and at < len(self.waiting):
            req = self.waiting[at]
            # FIFO: later requests wait too, so a big one is not starved; a preempted request
            # whose newest token is still on the device is recomputed once the token is known
            if req.num_inflight:
                break
            hit = self.cache.lookup(req) if self.cache is not None else None
            if self.cache is not None and self.cache.should_wait(req, hit):
                at += 1  # this step computes its prefix: it resumes from there next step
                continue
            if not self._admit(req, hit, batch.copies):
                break
            del self.waiting[at]
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= self._prefill(batch, req, budget)
        return batch

    def _prefill(self, batch: ScheduledBatch, req: Request, budget: int) -> int:
        """Schedule req's next prefill chunk (with its checkpoints); the rows it takes."""
        n = min(req.num_pending, budget)
        batch.prefill.append((req, n))
        if self.cache is not None:
            captures = self.cache.plan_captures(req, req.num_computed, n, batch.copies)
            if captures:
                batch.captures[req.request_id] = captures
        halo = self.pool.cfg.prefill_halo
        if halo and req.params.prompt_logprobs is None:  # (every prompt row's logits: all rows)
            batch.anchors[req.request_id] = self._anchors(req, req.num_computed, n + halo)
        return n

    def _anchors(self, req: Request, start: int, n: int) -> tuple[int, ...]:
        """Where in (start, start + n] the state of `req` must be exact: where it samples (its
        known tokens' end) and where the prefix cache may checkpoint it (positions the cache
        decides from the request alone, so a later chunk's captures were anchors of the chunks
        before it)."""
        ends = {req.num_tokens} if start < req.num_tokens <= start + n else set()
        if self.cache is not None:
            ends.update(self.cache.capture_positions(req, start, n))
        return tuple(sorted(a for a in ends if a <= req.num_tokens))  # (later ones are decoded)

    def _admit(self, req: Request, hit: Hit | None, copies: CopyPlan) -> bool:
        """Give a waiting request its pages, resumed from `hit` (the copies it needs planned)."""
        if hit is None:
            if not self.try_allocate(req, req.num_tokens + self.draft_tokens):
                return False
        elif not self._resume(req, hit, copies):
            return False
        if self.cache is not None:
            shared = self.cache.shared_length(req)
            worth = shared >= req.num_computed + self.cache.block
            req.branch_point = shared if worth else None
        if req.num_cached_tokens is None:  # its first admission
            req.num_cached_tokens = req.num_computed
            if self.cache is not None:
                self.cache.stats.queries += len(req.prompt_token_ids)
                self.cache.stats.hits += req.num_computed
        return True

    def _resume(self, req: Request, hit: Hit, copies: CopyPlan) -> bool:
        if not self._share(req, hit, req.num_tokens + self.draft_tokens):
            return False
        assert self.cache is not None
        self.cache.restore(req, hit, copies)
        return True

    def _share(self, req: Request, hit: Hit, need: int) -> bool:
        """Give `req` pages for `need` tokens, the full entry pages of `hit`'s prefix shared
        (brought back from the host tier where they went); False if there is no room."""
        cache = self.cache
        assert cache is not None
        cache.pin(hit)  # (evictions that make room for it must not take it)
        try:
            shared = cache.shared_pages(hit) if cache.bring_back(hit) else None
            return shared is not None and self.try_allocate(req, need, shared)
        finally:
            cache.unpin(hit)

    def _grow_or_preempt(self, req: Request) -> bool:
        """Make room for one more token of `req` and its drafts (and the positions its MTP
        layer drafts past them); False if `req` itself had to be preempted."""
        rows = 1 + len(req.draft_token_ids)
        while not self.try_allocate(req, req.num_computed + rows + self.draft_tokens):
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
        req.draft_token_ids = []  # (its draft head's state went with its pages)
        req.draft_confidences = []
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- KV pages

    def try_allocate(
        self, req: Request, num_tokens: int, shared: dict[str, list[int]] | None = None
    ) -> bool:
        """Grow req's page tables (and give it a slab row) to cover `num_tokens` tokens; a
        request that holds none yet and resumes from the prefix cache shares the full entry
        pages `shared` (its tables: its ring pages, the shared pages, then its own). Evicts what
        only the prefix cache holds when the pools are short."""
        pool = self.pool
        shared = shared or {}
        need = {
            g: pool.pages_for(g, num_tokens)
            - len(req.page_tables.get(g, []))
            - len(shared.get(g, []))
            for g in pool.groups
        }
        if req.slab is None and not pool.slab.num_free:
            return False
        if self.cache is not None:
            if not self.cache.make_room(need):
                return False
        elif any(n > pool.groups[g].allocator.num_free for g, n in need.items()):
            return False
        if req.slab is None:
            try:
                req.slab = pool.slab.allocate(1)[0]
            except OutOfPages:
                return False
        for g, n in need.items():
            pages = pool.groups[g].allocator.allocate(n) if n > 0 else []
            if shared.get(g):
                pool.groups[g].allocator.incref(shared[g])
                pages = pages[: pool.ring_pages] + shared[g] + pages[pool.ring_pages :]
            if pages:
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
    """Past its prompt with one token to compute (a prompt resumed one token short of its end
    still prefills: its chunk may leave a checkpoint)."""
    return req.num_computed >= len(req.prompt_token_ids) and req.num_pending == 1
