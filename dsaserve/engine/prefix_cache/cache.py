"""Automatic prefix caching: requests resume from the KV state of an earlier one with the same
leading tokens, instead of computing it again.

What is cached (engine.prefix_cache.checkpoint says why these are what resuming needs):
- a tree of token blocks (`Node`, B = the page size tokens each, named by the chained hashes of
  engine.prefix_cache.block_hash and holding their tokens): node d is the prefix [0, d*B) of
  some request;
- on the node whose prefix ends where an entry page closes (every P * ratio tokens of a compressed
  group), that full entry page, shared by reference with every request that resumes past it;
- checkpoints (`Checkpoint`): a request's window ring and compressor rings at one position, copied
  at the end of every prompt the engine computes, every `interval` tokens along it
  (--prefix-cache-checkpoint-interval, 512), where a prompt parts from a cached one (its
  `branch_point`: a shared system prompt shorter than the interval is resumed there) and where a
  request that ran to its end stops (`keep`: its prompt and answer, what a conversation's next
  turn starts with), kept on the node of the block they fall in (with the tokens between the
  node's end and their position), plus a reference to each group's open entry page. Where rows
  run short a step captures its deepest positions first (a prompt's end before its intervals).
  Checkpoint rows are a fixed share of the KV budget (engine.kv.layout.default_checkpoint_rows);
  what one costs, and why this rather than every token's window rows, is in
  engine.prefix_cache.checkpoint.
A request resumes at the deepest checkpoint whose tokens it shares: at the checkpoint's position
c, or at c - 1 when it shares only c - 1 of them (recomputing position c - 1 rewrites everything
that position wrote, the state of the others at c is what it was at c - 1); a request must compute
one token at least, so a prompt sent again resumes at its length minus one, the next turn of a
conversation computes only what follows its last answer (and that answer's last token, sampled
but never computed), and any prompt sharing L tokens resumes at L - interval or later.

Sharing: a page belongs to everyone who references it (engine.kv.allocator): requests' page
tables, nodes, checkpoints. Full entry pages are never written again, so sharing them is safe; a
resumed request gets copies of the rest, which it then writes. Eviction drops the least recently
used checkpoint (made or resumed from) that no request is being restored from, then every node
whose subtree no longer holds a checkpoint (its entry pages with it): a page a running request
uses only loses the cache's reference. Nothing is evicted that the step being built captures.

Host tier (`--kv-offloading-size`, engine.prefix_cache.host_tier): with one, an evicted
checkpoint moves to pinned host memory instead of going (its ring pages, slab row and open pages
packed into host blocks), and so do a node's full pages once no checkpoint on the device lies
below it (`Node.device_below`); a hit on either brings it back into device pages first, in the
step that resumes from it. Host memory runs out the same way: its least recently used
checkpoint goes.

Timing: a checkpoint is registered when the step that computes it is scheduled, and its bytes
are written on the engine's stream by that step; a request may resume from it from the next
step on (every copy follows on the same stream). A request whose prefix another request is
computing in the step being scheduled waits for it (`should_wait`) rather than computing it too;
if that request is aborted, what its launched steps computed is still there.

A family whose state at a position is nothing but the entries before it (no window ring, no
compressor rings: DeepSeek-V3.2, one latent row and index key per token) needs no checkpoint to
resume: it resumes at any node's end, or further into a child's full page or a checkpoint's open
page (a copy of its first entries), so a prompt sharing L tokens with a cached one resumes at L.
Its checkpoints (the end of every prompt, ...) own nothing: they keep the prefix's nodes (its
pages) in the tree, the open page at their position, and the LRU order eviction follows. A hit's
nodes stay pinned until the step's copies have read them.

Namespaces: a request's `SamplingParams.cache_salt` (vLLM's field, which the router also uses
for the tenant of an API key) names a tree of its own, rooted at the cache's salt with it mixed
in (block_hash.salted): its prompts match only prefixes computed under the same salt, never
another's, whatever their tokens, so a cache hit (time to first token, `cached_tokens`) says
nothing across namespaces. Requests without one share the default tree (`root`). A namespace's
root goes with its last node.

Every decision here is bookkeeping on page ids; the scheduler runs it on rank 0, and the copies it
plans (the step's CopyPlan, `begin_step`) run on every rank of a tensor-parallel group (the same
page ids and host blocks everywhere).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsaserve.engine.kv.layout import SLAB, ring_elems
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.prefix_cache.block_hash import block_hashes, salted
from dsaserve.engine.prefix_cache.checkpoint import Capture, CopyPlan
from dsaserve.engine.prefix_cache.host_tier import HostTier
from dsaserve.engine.request import Request


@dataclass(eq=False)
class Node:
    """Block `tokens` ending at `end`, after the prefix its parent names."""

    end: int  # tokens [0, end) are this node's prefix
    hash: bytes  # block_hashes(prefix)[-1], the root's: the salt
    tokens: tuple[int, ...]  # tokens [end - B, end)
    parent: Node | None
    children: dict[bytes, Node] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)  # group -> its entry page full at `end`
    checkpoints: list[Checkpoint] = field(default_factory=list)  # positions in [end, end + B)
    host: list[int] | None = None  # its pages' host blocks, when they moved there
    host_groups: tuple[str, ...] = ()  # the groups of those pages, in order
    device_below: int = 0  # checkpoints on the device at or below this node
    step: int = 0  # the step that computes its pages: a request may resume from it after that
    pins: int = 0  # requests that read its prefix's pages in the step being scheduled

    def ancestry(self) -> list[Node]:
        """The nodes from the root down to this one, index = depth."""
        out: list[Node] = [self]
        while (parent := out[-1].parent) is not None:
            out.append(parent)
        return out[::-1]


@dataclass(eq=False)
class Checkpoint:
    """A request's window ring and compressor rings as they were after `position` tokens."""

    position: int
    node: Node
    tail: tuple[int, ...]  # tokens [node.end, position)
    ring: dict[str, list[int]]  # group -> copies of the window ring pages (owned)
    slab: int | None  # its checkpoint slab row: the compressor rings (owned; None: stateless)
    open_pages: dict[str, int]  # group -> the entry page still open at `position` (shared)
    step: int  # the step that computes it; a request may resume from it after that step
    pins: int = 0  # requests being restored from it right now
    used: int = 0  # the last step a request resumed from it (it stays on the device in that step)
    host: list[int] | None = None  # on the host tier: its blocks (ring, slab row, open pages)
    open_groups: tuple[str, ...] = ()  # on the host tier: the groups of its open pages


@dataclass(frozen=True)
class Hit:
    """Where a request resumes: `position` tokens in, the full pages from `node`'s ancestry, the
    rest from `checkpoint`'s state (None: a stateless family's node holds all of it)."""

    position: int
    node: Node
    checkpoint: Checkpoint | None = None


@dataclass
class CacheStats:
    """What /metrics reports: tokens looked up and found (as vLLM counts them), evictions."""

    queries: int = 0  # prompt tokens of requests looked up
    hits: int = 0  # of those, tokens resumed from the cache
    evictions: int = 0  # checkpoints evicted from the device (moved to the host tier, or gone)
    host_loads: int = 0  # checkpoints brought back from the host tier


class PrefixCache:
    def __init__(
        self, pool: KVPool, interval: int, salt: bytes, host: HostTier | None = None
    ) -> None:
        """interval: tokens between the checkpoints kept along a prompt; salt: engine.kv.
        block_hash.cache_salt of the model and layout; host: the second tier, if any."""
        self.pool, self.interval, self.salt, self.host = pool, interval, salt, host
        self.block = pool.page_size
        self.root = Node(0, salt, (), None)  # requests without a cache_salt start here
        self._roots: dict[bytes, Node] = {salt: self.root}  # every namespace's, by its salt
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()  # on the device, oldest first
        self._host_lru: OrderedDict[Checkpoint, None] = OrderedDict()  # on the host tier
        self._step = 0  # the step being scheduled
        self._plan = CopyPlan()  # its copies
        self._loaded: list[list[int]] = []  # host blocks its loads read (free from the next)
        self._pinned: list[Node] = []  # nodes whose pages its copies read (until the next step)
        # the state at a position is only the entries before it (module docstring)
        self.stateless = pool.ring_pages == 0 and ring_elems(pool.cfg) == 0
        self.stats = CacheStats()
        # (hash, stored?) of every node made or dropped, for who routes by them (None: nobody)
        self.events: list[tuple[bytes, bool]] | None = None
        P = pool.page_size
        self._compressed = {g: grp.ratio for g, grp in pool.groups.items() if grp.ratio}
        self._page_tokens = {g: P * r for g, r in self._compressed.items()}

    # ---------------------------------------------------------------- steps

    def begin_step(self) -> CopyPlan:
        """A new step is being scheduled (or scored): what earlier ones capture is now
        restorable. Returns the plan its copies go into, which must run before it."""
        self._step += 1
        self._plan = CopyPlan()
        pinned, self._pinned = self._pinned, []
        for node in pinned:
            node.pins -= 1
            self._prune(node)
        if self.host is not None:  # the last plan read them: their blocks may be written again
            for blocks in self._loaded:
                self.host.allocator.free(blocks)
        self._loaded = []
        return self._plan

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru) + len(self._host_lru)

    # ---------------------------------------------------------------- lookup

    def lookup(self, req: Request, pending: bool = False) -> Hit | None:
        """Where `req` (which holds no KV) can resume: the deepest usable checkpoint of its
        known tokens, leaving at least one to compute. `pending`: also checkpoints the step
        being scheduled computes (to tell whether waiting a step would pay). None for a request
        that wants its prompt's logprobs: it computes every prompt row."""
        if req.params.prompt_logprobs is not None:
            return None
        tokens = known_tokens(req)
        limit = len(tokens) - 1
        node = self._walk(req, tokens)
        d, B = node.end // self.block, self.block
        ready = (lambda ck: True) if pending else (lambda ck: ck.step < self._step)
        if self.stateless:
            return self._lookup_entries(node, tokens, limit, ready)
        candidates: list[tuple[int, Checkpoint]] = []
        if (d + 1) * B <= len(tokens):  # the next block differs: in its last token only?
            block = tuple(tokens[d * B : (d + 1) * B - 1])
            for child in node.children.values():
                if child.tokens[:-1] == block:
                    candidates += [(child.end - 1, ck) for ck in child.checkpoints if not ck.tail]
        at: Node | None = node
        while at is not None and not any(ready(ck) for _, ck in candidates):
            for ck in at.checkpoints:
                m = _common(ck.tail, tokens[at.end : at.end + len(ck.tail)])
                if m == len(ck.tail) and ck.position <= limit:
                    candidates.append((ck.position, ck))
                elif m >= len(ck.tail) - 1 and ck.position - 1 <= limit:
                    candidates.append((ck.position - 1, ck))
            at = at.parent
        usable = [(p, ck) for p, ck in candidates if p >= 1 and ready(ck)]
        if not usable:
            return None
        position, ck = max(usable, key=lambda c: c[0])
        return Hit(position, ck.node, ck)

    def _lookup_entries(
        self,
        node: Node,
        tokens: Sequence[int],
        limit: int,
        ready: Callable[[Node | Checkpoint], bool],
    ) -> Hit | None:
        """A stateless family's resume point below `node` (the deepest one `tokens` starts
        with): its end, or as far as a child's page or a checkpoint's tail goes on matching."""
        while node.parent is not None and not ready(node):
            node = node.parent
        after = tokens[node.end :]
        candidates = [Hit(min(node.end, limit), node)]
        candidates += [
            Hit(min(node.end + _common(child.tokens, after), limit), child)
            for child in node.children.values()
            if ready(child)
        ]
        candidates += [
            Hit(min(node.end + _common(ck.tail, after), limit), node, ck)
            for ck in node.checkpoints
            if ready(ck)
        ]
        best = max(candidates, key=lambda hit: hit.position)
        return best if best.position >= 1 else None

    def lookup_pages(self, req: Request, limit: int | None = None) -> Hit | None:
        """Where a request whose state arrives from elsewhere (a transfer brings its rings,
        slab row and open pages) can share the full entry pages of its prompt (of its first
        `limit` tokens): the deepest cached node it starts with (None: none)."""
        node = self._walk(req, req.prompt_token_ids[:limit])
        while node.parent is not None and node.step >= self._step:
            node = node.parent
        return None if node.parent is None else Hit(node.end, node)

    def shared_length(self, req: Request) -> int:
        """How many of `req`'s leading tokens some cached prefix shares (checkpoint or not)."""
        tokens = known_tokens(req)
        node = self._walk(req, tokens)
        after = tokens[node.end :]
        seqs = [c.tokens for c in node.children.values()] + [ck.tail for ck in node.checkpoints]
        return node.end + max((_common(seq, after) for seq in seqs), default=0)

    def should_wait(self, req: Request, hit: Hit | None) -> bool:
        """Whether `req` had better wait a step: a checkpoint the step being scheduled computes
        would let it resume at least a block further than it can now."""
        ahead = self.lookup(req, pending=True)
        now = hit.position if hit is not None else 0
        return ahead is not None and ahead.position >= now + self.block

    def _walk(self, req: Request, tokens: Sequence[int]) -> Node:
        """The deepest node whose whole prefix `tokens` starts with."""
        B, hashes = self.block, self._hashes(req, tokens)
        node = self._root(req, create=False)
        for d in range(len(hashes)):
            child = node.children.get(hashes[d])
            if child is None or child.tokens != tuple(tokens[d * B : (d + 1) * B]):
                break
            node = child
        return node

    def _hashes(self, req: Request, tokens: Sequence[int]) -> list[bytes]:
        if len(req.block_hashes) < len(tokens) // self.block:
            salt = salted(self.salt, req.params.cache_salt)
            req.block_hashes = block_hashes(tokens, salt, self.block, req.block_hashes)
        return req.block_hashes

    def _root(self, req: Request, create: bool) -> Node:
        """The root of `req`'s namespace; an empty one, not kept, unless `create`."""
        salt = salted(self.salt, req.params.cache_salt)
        root = self._roots.get(salt)
        if root is None:
            root = Node(0, salt, (), None)
            if create:
                self._roots[salt] = root
        return root

    # ---------------------------------------------------------------- restore

    def pin(self, hit: Hit) -> None:
        """Keep the hit's checkpoint while the request is given pages, and its nodes until the
        step's copies have read them."""
        if hit.checkpoint is not None:
            hit.checkpoint.pins += 1
        hit.node.pins += 1
        self._pinned.append(hit.node)

    def unpin(self, hit: Hit) -> None:
        if hit.checkpoint is not None:
            hit.checkpoint.pins -= 1

    def bring_back(self, hit: Hit) -> bool:
        """Put on the device what resuming from `hit` reads (the checkpoint and the full pages
        of its prefix) where it is on the host tier, evicting to make room; False if there is
        none. The loads are planned into this step's copies. A pinned hit stays pinned."""
        ck, chain = hit.checkpoint, hit.node.ancestry()
        self._count_device(hit.node, +1)  # (its prefix's pages must not leave while it comes)
        need: dict[str, int] = dict.fromkeys(self.pool.groups, 0)
        for node in chain:
            for g in node.host_groups:
                need[g] += 1
        loads_ck = ck is not None and ck.host is not None
        if ck is not None and ck.host is not None:
            for g in self.pool.groups:
                need[g] += self.pool.ring_pages + (g in ck.open_groups)
        rows = int(loads_ck and not self.stateless)
        if not self.make_room(need, checkpoint_rows=rows):
            self._count_device(hit.node, -1, offload=False)
            return False
        for node in chain:
            if node.host is not None:
                assert self.host is not None
                node.pages = {g: self._alloc(g, 1)[0] for g in node.host_groups}
                self._load(node.host, {g: [p] for g, p in node.pages.items()})
                node.host, node.host_groups = None, ()
        if ck is None or ck.host is None:
            self._count_device(hit.node, -1, offload=False)  # (it was counted already)
        else:
            ck.ring = {g: self._alloc(g, self.pool.ring_pages) for g in self.pool.groups}
            if not self.stateless:
                ck.slab = self.pool.checkpoint_slab.allocate(1, cached=True)[0]
            ck.open_pages = {g: self._alloc(g, 1)[0] for g in ck.open_groups}
            assert ck.host is not None
            self._load(ck.host, self._pages(ck))
            ck.host, ck.open_groups = None, ()
            del self._host_lru[ck]
            self._lru[ck] = None
            self.stats.host_loads += 1
        return True

    def shared_pages(self, hit: Hit) -> dict[str, list[int]]:
        """The full entry pages a request resuming from `hit` shares (on the device: after
        bring_back), per compressed group, in order."""
        chain, P, B = hit.node.ancestry(), self.pool.page_size, self.block
        return {
            g: [
                chain[(k + 1) * self._page_tokens[g] // B].pages[g]
                for k in range((hit.position // r) // P)
            ]
            for g, r in self._compressed.items()
        }

    def restore(self, req: Request, hit: Hit, plan: CopyPlan) -> None:
        """`req`'s tables hold its own ring pages, then its shared pages, then pages of its own:
        plan the copies that give it the checkpoint's state at hit.position."""
        ck, ring, P, B = hit.checkpoint, self.pool.ring_pages, self.pool.page_size, self.block
        chain = hit.node.ancestry()
        src: dict[str, list[int]] = {}
        dst: dict[str, list[int]] = {}
        if ck is not None and ck.slab is not None:
            src[SLAB], dst[SLAB] = [ck.slab], [req.slab_row]
        for g in self.pool.groups:
            table = req.page_tables[g]
            src[g], dst[g] = list(ck.ring[g]) if ck is not None else [], table[:ring]
            r = self._compressed.get(g)
            if r and (hit.position // r) % P:  # the page still open at the position: a copy
                full = (hit.position // r) // P
                if ck is not None and full == (ck.position // r) // P:
                    src[g].append(ck.open_pages[g])
                else:  # (full at a node further down)
                    src[g].append(chain[(full + 1) * self._page_tokens[g] // B].pages[g])
                dst[g].append(table[ring + full])
        plan.add(src, dst)
        req.num_computed = hit.position
        if ck is not None:
            ck.used = self._step
            self._lru.move_to_end(ck)

    # ---------------------------------------------------------------- capture

    def capture_positions(self, req: Request, start: int, n: int) -> list[int]:
        """Where a chunk [start, start + n) of `req` ends a checkpoint interval, its prompt, or
        the prefix it shares with a cached one (where the next request with that prefix, a
        system prompt say, resumes)."""
        end, every = start + n, self.interval
        out = list(range((start // every + 1) * every, end + 1, every))
        for at in (req.branch_point, len(req.prompt_token_ids)):
            if at is not None and start < at <= end and at not in out:
                out.append(at)
        return sorted(out)

    def plan_captures(
        self, req: Request, start: int, n: int, plan: CopyPlan
    ) -> tuple[Capture, ...]:
        """Checkpoints of `req` inside its chunk [start, start + n) of this step: registered now
        (restorable after this step), their pages taken from the free ones or by evicting older
        checkpoints (skipped where neither gives room); plans the copy of the request's rings as
        of `start`, which the step completes (engine.prefix_cache.checkpoint)."""
        tokens = known_tokens(req)
        out = []
        # (deepest first: where rows run short, the prompt's end is what a repeat resumes from)
        for c in reversed(self.capture_positions(req, start, n)):
            if c > len(tokens) or self._holds(req, tokens, c):
                continue
            ck = self._checkpoint(req, tokens, c, plan, self._step)
            if ck is None:
                break
            if ck.slab is not None:
                out.append(Capture(c, ck.slab, ck.ring))
        return tuple(out)

    def keep(self, req: Request) -> CopyPlan:
        """What a request that ran to its end computed stays: the full entry pages of its known
        tokens on their nodes and a checkpoint of its state at its last computed position
        (its prompt and answer: what its conversation's next turn starts with), where room can
        be made. Returns the copies, which must run before its pages are written again (on the
        engine's stream, before any later step or transfer)."""
        tokens = known_tokens(req)
        c = min(req.num_computed, len(tokens))
        step_plan, self._plan = self._plan, CopyPlan()  # (evictions' saves go with the copies)
        try:
            if c >= 1 and not self._holds(req, tokens, c):
                # (whole once these copies have run, before any later step: resumable at once)
                self._checkpoint(req, tokens, c, self._plan, self._step - 1)
            return self._plan
        finally:
            self._plan = step_plan

    def _checkpoint(
        self, req: Request, tokens: Sequence[int], c: int, plan: CopyPlan, step: int
    ) -> Checkpoint | None:
        """Register a checkpoint of `req` at `c`, whole after step `step`, and plan the copy of
        its rings as they are into the checkpoint's own (a stateless family's owns none); None
        without room."""
        pool = self.pool
        rows = 0 if self.stateless else 1
        if not self.make_room(dict.fromkeys(pool.groups, pool.ring_pages), rows):
            return None
        if self.stateless:  # (nothing of its own to copy: its nodes take the pages)
            return self._register(req, tokens, c, dict.fromkeys(pool.groups, []), None, step)
        ring = {g: self._alloc(g, pool.ring_pages) for g in pool.groups}
        slab = pool.checkpoint_slab.allocate(1, cached=True)[0]
        now = {g: req.page_tables[g][: pool.ring_pages] for g in pool.groups}
        plan.add({**now, SLAB: [req.slab_row]}, {**ring, SLAB: [slab]})
        return self._register(req, tokens, c, ring, slab, step)

    def _holds(self, req: Request, tokens: Sequence[int], c: int) -> bool:
        """Whether a checkpoint at `c` of these tokens exists."""
        node = self._path(req, tokens, c // self.block, create=False)
        tail = tuple(tokens[node.end : c]) if node is not None else None
        return node is not None and any(ck.tail == tail for ck in node.checkpoints)

    def _path(self, req: Request, tokens: Sequence[int], depth: int, create: bool) -> Node | None:
        """The node of tokens [0, depth * B) (made, with its ancestors, if `create`)."""
        B, hashes = self.block, self._hashes(req, tokens)
        node = self._root(req, create)
        for d in range(depth):
            child = node.children.get(hashes[d])
            block = tuple(tokens[d * B : (d + 1) * B])
            if child is not None and child.tokens != block:
                return None  # (a hash collision: this prefix is not cached)
            if child is None:
                if not create:
                    return None
                child = Node((d + 1) * B, hashes[d], block, node)
                node.children[hashes[d]] = child
                if self.events is not None:
                    self.events.append((hashes[d], True))
            node = child
        return node

    def _register(
        self,
        req: Request,
        tokens: Sequence[int],
        c: int,
        ring: dict[str, list[int]],
        slab: int | None,
        step: int,
    ) -> Checkpoint:
        node = self._path(req, tokens, c // self.block, create=True)
        assert node is not None, "a hash collision with a cached prefix"
        chain, P, B = node.ancestry(), self.pool.page_size, self.block
        opened = {}
        for g, r in self._compressed.items():
            table, first = req.page_tables[g], self.pool.ring_pages
            alloc = self.pool.groups[g].allocator
            for k in range((c // r) // P):  # every full page before c, on its node
                holder = chain[(k + 1) * self._page_tokens[g] // B]
                if g not in holder.pages and g not in holder.host_groups:
                    holder.pages[g] = table[first + k]
                    holder.step = step
                    alloc.incref([holder.pages[g]], cached=True)
            if (c // r) % P:
                opened[g] = table[first + (c // r) // P]
                alloc.incref([opened[g]], cached=True)
        ck = Checkpoint(c, node, tuple(tokens[node.end : c]), ring, slab, opened, step)
        node.checkpoints.append(ck)
        self._lru[ck] = None
        self._count_device(node, +1)
        return ck

    # ---------------------------------------------------------------- eviction

    def make_room(self, need: dict[str, int], checkpoint_rows: int = 0) -> bool:
        """Evict until every group has `need[g]` free pages and the checkpoint rows
        `checkpoint_rows` free rows; False if the cache runs out of what it may evict first."""
        pool = self.pool

        def short() -> bool:
            return pool.checkpoint_slab.num_free < checkpoint_rows or any(
                n > pool.groups[g].allocator.num_free for g, n in need.items()
            )

        while short():
            if not self.evict_one():
                return False
        return True

    def evict_one(self) -> bool:
        """Move the least recently used checkpoint on the device that may go to the host tier,
        or drop it; with none on the device, drop the host tier's oldest (its prefix's pages may
        still be on the device). False if nothing may go."""
        now = self._step
        ck = next((c for c in self._lru if not c.pins and c.step < now and c.used < now), None)
        if ck is not None:
            if not self._to_host(ck):
                self._drop(ck)
            self.stats.evictions += 1
            return True
        ck = next((c for c in self._host_lru if not c.pins), None)
        if ck is None:
            return False
        self._drop(ck)
        return True

    def clear(self) -> None:
        """Drop every checkpoint that may go (an idle engine's: all of them, both tiers)."""
        while self._lru and self.evict_one():
            pass
        while self._host_lru:
            self._drop(next(iter(self._host_lru)))
        self.begin_step()  # (the host blocks of loads already run)

    def _to_host(self, ck: Checkpoint) -> bool:
        """Move a device checkpoint to the host tier (making room there by dropping its oldest);
        False where there is no tier or it cannot hold it."""
        if self.host is None:
            return False
        pages = self._pages(ck)
        blocks = self._host_blocks(pages)
        if blocks is None:
            return False
        self._save(pages, blocks)
        self._free_device(ck)
        ck.host, ck.open_groups = blocks, tuple(ck.open_pages)
        ck.ring, ck.open_pages = {}, {}
        del self._lru[ck]
        self._host_lru[ck] = None
        self._count_device(ck.node, -1)
        return True

    def _drop(self, ck: Checkpoint) -> None:
        if ck.host is None:
            self._free_device(ck)
            del self._lru[ck]
        else:
            assert self.host is not None
            self.host.allocator.free(ck.host)
            del self._host_lru[ck]
        ck.node.checkpoints.remove(ck)
        self._prune(ck.node)
        if ck.host is None:  # (counted off along the nodes that stay, and those pruned)
            self._count_device(ck.node, -1)

    def _prune(self, node: Node) -> None:
        """Drop `node` and then its ancestors, with their pages, while nothing keeps them: no
        checkpoint or child below, no request reading them this step."""
        pool, parent = self.pool, node.parent
        while parent is not None and not (node.children or node.checkpoints or node.pins):
            for g, page in node.pages.items():
                pool.groups[g].allocator.free([page], cached=True)
            if node.host is not None:
                assert self.host is not None
                self.host.allocator.free(node.host)
            node.pages, node.host = {}, None
            del parent.children[node.hash]
            if self.events is not None:
                self.events.append((node.hash, False))
            node, parent = parent, parent.parent
        if parent is None and node is not self.root and not (node.children or node.checkpoints):
            self._roots.pop(node.hash, None)  # (an empty namespace)

    def _count_device(self, node: Node, by: int, offload: bool = True) -> None:
        """Count a checkpoint onto or off the device at `node`; with `offload`, a node no
        device checkpoint lies below any more moves its pages to the host tier (if it can)."""
        at: Node | None = node
        while at is not None:
            at.device_below += by
            # (not a node a step's copies read: its pages must stay where they are)
            if offload and at.device_below == 0 and at.pages and at.parent and not at.pins:
                pages = {g: [p] for g, p in at.pages.items()}
                blocks = self._host_blocks(pages, drop_for_room=False)
                if blocks is not None:
                    self._save(pages, blocks)
                    for g, p in at.pages.items():
                        self.pool.groups[g].allocator.free([p], cached=True)
                    at.host, at.host_groups, at.pages = blocks, tuple(at.pages), {}
            at = at.parent

    # ---------------------------------------------------------------- pages and blocks

    def _alloc(self, group: str, n: int) -> list[int]:
        return self.pool.groups[group].allocator.allocate(n, cached=True)

    def _pages(self, ck: Checkpoint) -> dict[str, list[int]]:
        """A device checkpoint's own pages, by group (its slab row under "slab")."""
        out = {
            g: [*ck.ring[g], *([ck.open_pages[g]] if g in ck.open_pages else [])] for g in ck.ring
        }
        return out if ck.slab is None else {**out, SLAB: [ck.slab]}

    def _free_device(self, ck: Checkpoint) -> None:
        pool = self.pool
        for g, pages in ck.ring.items():
            pool.groups[g].allocator.free(pages, cached=True)
        for g, page in ck.open_pages.items():
            pool.groups[g].allocator.free([page], cached=True)
        if ck.slab is not None:
            pool.checkpoint_slab.free([ck.slab], cached=True)

    def _host_blocks(
        self, pages: dict[str, list[int]], drop_for_room: bool = True
    ) -> list[int] | None:
        """Host blocks for these pages' bytes, dropping the host tier's oldest checkpoints for
        room where allowed; None if the tier cannot hold them."""
        if self.host is None:
            return None
        need = self.host.blocks_for(self.pool.stream_bytes(pages) // self.pool.cell_bytes)
        while need > self.host.num_free and drop_for_room:
            oldest = next((c for c in self._host_lru if not c.pins), None)
            if oldest is None:
                break
            self._drop(oldest)
        if need > self.host.num_free:
            return None
        return self.host.allocator.allocate(need)

    def _save(self, pages: dict[str, list[int]], blocks: list[int]) -> None:
        self._plan.saves.append((pages, blocks))

    def _load(self, blocks: list[int], pages: dict[str, list[int]]) -> None:
        self._plan.loads.append((blocks, pages))
        self._loaded.append(blocks)

    # ---------------------------------------------------------------- accounting

    @property
    def num_cached_pages(self) -> int:
        """Pages of the groups only the cache holds: free as soon as it evicts them."""
        return sum(g.allocator.num_cached for g in self.pool.groups.values())

    def take_events(self, snapshot: bool) -> tuple[list[bytes] | None, list[tuple[bytes, bool]]]:
        """What a router needs to know of the cache since the last call: (with `snapshot`, the
        hash of every node it holds; else None) and every node made (True) or dropped (False) since,
        in order. The first call starts the recording."""
        events, self.events = self.events or [], []
        if not snapshot:
            return None, events
        hashes, stack = [], [n for root in self._roots.values() for n in root.children.values()]
        while stack:
            node = stack.pop()
            hashes.append(node.hash)
            stack.extend(node.children.values())
        return hashes, []


def known_tokens(req: Request) -> list[int]:
    """The request's tokens whose ids are on the host (prompt, then what it sampled)."""
    return req.prompt_token_ids + req.output_token_ids


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
