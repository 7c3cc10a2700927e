"""A request's KV state at one position, as the prefix cache keeps it: how a step captures it and
how a request is restored from it. The bookkeeping (which checkpoints exist, who shares which
page) is engine.prefix_cache.cache's; this module moves the bytes.

What resuming a request at position c needs, per pool group (engine.kv.pool):
- the compressed entries of the windows closed before c: full entry pages are immutable once
  written, so they are shared by reference; the open page (entries still being added) is copied;
- the window rows of the last `sliding_window - 1` positions: the ring pages, copied;
- every compressor's ring (raw projections of the open windows): the slab row, copied.
A checkpoint owns copies of the last two (ring pages from the groups' allocators, a slab row from
the pool's checkpoint rows) and references the open entry page. The first kind is most of the
bytes and never changes once a page is full; the other two are small but exist only where kept.
On DeepSeek-V4-Flash with FP8 pages a checkpoint is 9.9 MiB (6.5 of them the compressor rings,
kept in bf16), against 1.8 MiB of compressed entries per 512 tokens; keeping every token's window
rows instead would cost 12.3 MiB per 512 tokens (engine.kv.layout.checkpoint_bytes,
bytes_per_token).

Capturing at a position c inside a prefill chunk [s, e) (checkpoints fall every N tokens, a
chunk may hold several): before the step, the request's ring pages and slab row are copied to the
checkpoint's (their state at s); during it, every compressor also writes the rows of positions
[max(s, c - rows), c) into the checkpoint's slab row (`Capture`, carried by the step's RowSpan);
after it, the window rows of positions [max(s, c - ring_len), c) go from the step's scratch rows
(where every layer keeps this step's rows) to the checkpoint's ring slots (kernels.copy_rows,
which also copies FP8 pages' rows). Every device copy is on the engine's stream, so a checkpoint
captured by step N is whole for every step after N. A step's other copies (to and from the host
tier, page to page) are one `CopyPlan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dsaserve import kernels
from dsaserve.engine.async_copy import to_device
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.prefix_cache.host_tier import HostTier


@dataclass(frozen=True)
class Capture:
    """Where a step puts a request's state as of `position` (inside the step's chunk of it)."""

    position: int
    slab: int  # the checkpoint's slab row (its compressor rings)
    ring: dict[str, list[int]]  # group -> the checkpoint's ring pages

    def __reduce__(self) -> tuple:
        return Capture, (self.position, self.slab, self.ring)


@dataclass
class CopyPlan:
    """What to copy before a step, in this order:
    - saves: pages (and slab rows, group "slab") to the host tier's blocks
      (engine.prefix_cache.host_tier), read before anything below writes into them;
    - loads: host blocks into pages;
    - copies: pages into pages, in the order planned. A page written by an earlier copy is read
      through it (from that copy's source), so they run as one gather and one scatter that both
      see the state after the loads."""

    src: dict[str, list[int]] = field(default_factory=dict)
    dst: dict[str, list[int]] = field(default_factory=dict)
    saves: list[tuple[dict[str, list[int]], list[int]]] = field(default_factory=list)
    loads: list[tuple[list[int], dict[str, list[int]]]] = field(default_factory=list)
    _source: dict[tuple[str, int], int] = field(default_factory=dict)  # (group, dst) -> src

    def __getstate__(self) -> dict:
        # (sent to the other ranks of a tensor-parallel group without the planning's index)
        return {**self.__dict__, "_source": {}}

    def add(self, src: Mapping[str, Sequence[int]], dst: Mapping[str, Sequence[int]]) -> None:
        for group, ids in src.items():
            assert len(ids) == len(dst[group]), f"{group}: {len(ids)} pages to {len(dst[group])}"
            for s, d in zip(ids, dst[group], strict=True):
                s = self._source.get((group, s), s)
                self._source[group, d] = s
                self.src.setdefault(group, []).append(s)
                self.dst.setdefault(group, []).append(d)

    def __bool__(self) -> bool:
        return bool(self.dst or self.saves or self.loads)


def run_copies(pool: KVPool, plan: CopyPlan, host: HostTier | None) -> None:
    """Every rank: a CopyPlan on the current stream, each kind of copy as one gather and one
    scatter of the arena's cells (engine.kv.pool)."""
    for pages, blocks in plan.saves:
        assert host is not None
        host.save(pool.cells(pages), blocks)
    for blocks, pages in plan.loads:
        assert host is not None
        host.load(blocks, pool.cells(pages))
    if plan.dst:
        device = pool.cell_rows.device
        cells_from = to_device(pool.cells(plan.src), torch.int64, device)  # [n]
        cells_to = to_device(pool.cells(plan.dst), torch.int64, device)
        pool.cell_rows.index_copy_(0, cells_to, pool.cell_rows.index_select(0, cells_from))


def capture_window_rows(pool: KVPool, spans: Sequence[tuple[int, int, Sequence[Capture]]]) -> None:
    """After a step: the window rows each capture needs from the step's scratch rows into the
    capture's ring pages, in every layer. spans: (first row in the step, first position, the
    captures) of each prefill chunk that has some."""
    P, ring_len = pool.page_size, pool.ring_len
    rows: list[int] = []  # step rows (scratch rows past each group's base)
    pages: dict[str, list[int]] = {g: [] for g in pool.groups}  # ring page of each row's slot
    offsets: list[int] = []  # slot inside that page
    for row0, start, captures in spans:
        for cap in captures:
            for p in range(max(start, cap.position - ring_len), cap.position):
                rows.append(row0 + p - start)
                offsets.append(p % P)
                for g in pool.groups:
                    pages[g].append(cap.ring[g][(p % ring_len) // P])
    if not rows:
        return
    device = pool.device
    step_rows, offset = (to_device(x, torch.int64, device) for x in (rows, offsets))
    for g, group in pool.groups.items():
        src = pool.entry_slot_base(g) + step_rows
        dst = to_device(pages[g], torch.int64, device) * P + offset
        for layer in group.layers:
            kernels.copy_rows(group.kv[layer], src, dst, P)
