"""Preallocated, paged KV state of a model family, sized up front from a memory budget. The
family's config (engine.kv.layout.KVModel) says what it is; DeepSeek-V4's, described here, uses
every feature. DeepSeek-V3.2's is one group "mla" of rate 1 and no ring: a token's 576-wide
latent row and its index key sit at entry slot = its position, in the request's pages.

Per layer there is ONE slot space `kv[layer]` [slots, head_dim] holding both the sliding
window rows and the compressed entries, so one index list per query row feeds
`kernels.sparse_mla_decode`. Layers are grouped by kind (sliding "swa", CSA "csa", HCA
"hca"); each group has its own page allocator, and a request holds one page table per
group, shared by all layers of that group:

    page_table[group] = [ring pages ...][compressed pages ...]
    window row of position p    -> ring slot (p % ring_len)            (ring_len = ring_pages * P)
    compressed entry w          -> entry slot w, in the pages after the ring

CSA layers also keep the indexer's compressed keys `index_k[layer]` [slots, index_head_dim],
addressed by the same entry slots. Behind the pages of every `kv[layer]` sit scratch rows
that hold the rows computed in the current step (so a query can attend to tokens of its own
chunk before they are persisted to the ring; only for families that need them,
KVModel.needs_scratch_rows) and one trash row that absorbs writes which must not land anywhere
(keeps the decode step free of data-dependent shapes).

Small per-request state (each compressor's ring of recent raw projections) lives in the slab:
one row per running request, each layer's rings a view into it.

Every pool is a view into ONE zeroed allocation, the arena, at an offset that is a multiple of
the cell size (the largest size dividing every page). So each page of any pool, and each slab
row, is a run of whole cells, and a request's KV state is a list of cells (`cells`): what the
staging buffer (engine.kv.staging) gathers and scatters with one indexed copy. Each layer's pool
is still a contiguous [slots, D] tensor, what the kernels read, so a decode step does not change.
`regions()` lists what NIXL registers, `layout()` describes it and `layout_hash()` identifies it
across workers: the family, dtype, KV cache dtype, page size, ring, layer kinds, head dims and
every region's row shape, in order, and the staging block size, so two workers pair only when a
page or block of one means the same bytes to the other. The tensor-parallel size enters only
through this per-rank layout; DeepSeek's one KV head is whole on every rank, so groups of
different sizes pair (the size is advertised beside the hash, in the layout description that
KV handles and a mismatch's FAILED_PRECONDITION carry). A model whose KV heads split across
ranks would change the regions with the size, and so the hash.

Page tables live on the device too (`page_tables`, one row per slab row, written when pages are
allocated), so a decode step gathers its rows there instead of rebuilding tables on the host:
the host's work per decode token is O(1).

FP8 (`kv_cache_dtype="fp8"`, `--kv-cache-dtype fp8`): the pools hold kernels.kv_quant's paged
byte formats instead of model-dtype rows, as vLLM stores V4 with `--kv-cache-dtype fp8`:
- `kv[layer]` (window rows AND compressed entries, one slot space as above): uint8
  [pages, P * 584], FlashMLA's MODEL1 / vLLM's fp8_ds_mla format (448 e4m3 NoPE values with 7
  ue8m0 scales, 64 bf16 RoPE values): 584 bytes a row instead of 1024 in bf16. The scratch and
  trash rows sit in whole pages behind the request pages (slot s at page s // P either way).
  The release itself runs every KV row through this FP8 round trip before attention (its QAT),
  so these pages lose nothing the model was not trained with.
- `index_k[layer]`: uint8 [pages, P * (Di + 4)], e4m3 codes and one fp32 power-of-two scale a
  key (vLLM's V4 FP8 indexer cache), plus one page for the trash row.
- The compressor rings in the slab stay in the model dtype: they are raw projections and gate
  logits of windows still open, which the softmax pooling reads before any quantization (the
  release pools them unquantized and quantizes only the finished entry; vLLM keeps this state
  in fp32).
Every write goes through kernels.store_rows / the fused glue's FP8 branches (quantize on write),
every read through the kernels' FP8 loaders (sparse_mla_decode, indexer_topk). Budgets are in
bytes, so the same --kv-cache-memory-bytes holds more tokens than in bf16 pages: how many is
engine.kv.layout.bytes_per_token's ratio, recorded per model by bench/kv_cache_dtype.py. The
layout names the KV cache dtype, so a bf16 and an FP8 worker never pair; transfers and
`ModelRunner.share_pages` move the bytes as they are.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dsaserve import kernels
from dsaserve.engine.async_copy import to_device
from dsaserve.engine.kv import memory
from dsaserve.engine.kv.allocator import PageAllocator
from dsaserve.engine.kv.layout import (
    SLAB,
    STAGING,
    KVCacheConfig,
    KVModel,
    cell_bytes,
    check_kv_cache_dtype,
    element_size,
    plan_pages,
    ring_elems,
    ring_pages,
    round_up,
    scratch_pages,
    scratch_rows,
    staging_block_bytes,
)
from dsaserve.engine.kv.staging import KVStaging, Unpacker
from dsaserve.kernels.kv_quant import index_token_bytes, kv_token_bytes


class PoolRegion(NamedTuple):
    """One registrable tensor: dim 0 indexes the pages of `group` (slab rows for "slab",
    blocks for "staging")."""

    name: str
    group: str
    tensor: torch.Tensor


@dataclass
class PoolGroup:
    name: str
    layers: tuple[int, ...]
    ratio: int  # tokens per compressed entry; 0 = window only
    num_pages: int
    allocator: PageAllocator
    # layer -> [num_pages * P + scratch + 1, head_dim]; FP8: uint8 [pages, P * 584 (V4) or 656
    # (V3.2)], the pages past num_pages holding the scratch and trash rows
    kv: dict[int, torch.Tensor]
    # CSA layer -> [num_pages * P + 1, index_head_dim]; FP8: uint8 [num_pages + 1, P * (Di + 4)]
    index_k: dict[int, torch.Tensor]


class KVPool:
    def __init__(
        self,
        cfg: KVModel,
        kv_cfg: KVCacheConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int | None = None,
    ) -> None:
        self.cfg, self.kv_cfg, self.dtype, self.device = cfg, kv_cfg, dtype, torch.device(device)
        self.page_size = P = kv_cfg.page_size
        self.ring_pages = ring_pages(cfg, P, kv_cfg.speculative_tokens)
        self.ring_len = self.ring_pages * P
        self.scratch_rows = S = scratch_rows(cfg, kv_cfg)
        check_kv_cache_dtype(cfg, kv_cfg.kv_cache_dtype, P)
        self.fp8 = fp8 = kv_cfg.fp8
        # what a cached row is stored as (the layout names it): "fp8" or the model dtype
        self.kv_cache_dtype = "fp8" if fp8 else str(dtype).removeprefix("torch.")
        esize = element_size(dtype)
        layer_groups = cfg.kv_groups()
        self.cell_bytes = cell = cell_bytes(cfg, P, esize, fp8)
        block = staging_block_bytes(cfg, P, esize, fp8)
        pages, outbox = plan_pages(cfg, kv_cfg, esize, block)

        seqs = kv_cfg.max_num_seqs + 1
        rows = seqs + kv_cfg.checkpoint_rows  # the requests' slab rows, then the checkpoints'
        shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        for lg in layer_groups:
            n = pages[lg.name] + 1  # + one dummy page (below)
            for i in lg.layers:
                if fp8:  # scratch + trash rows in whole pages; the index trash row in one more
                    pages_kv = n + scratch_pages(P, S)
                    row = kv_token_bytes(cfg.head_dim)
                    shapes[lg.name, "kv", i] = (pages_kv, P * row), torch.uint8
                    if lg.indexed:
                        width = P * index_token_bytes(cfg.index_head_dim)
                        shapes[lg.name, "index_k", i] = (n + 1, width), torch.uint8
                else:
                    shapes[lg.name, "kv", i] = (n * P + S + 1, cfg.head_dim), dtype
                    if lg.indexed:
                        shapes[lg.name, "index_k", i] = (n * P + 1, cfg.index_head_dim), dtype
        spare = kv_cfg.speculative_tokens
        shapes[SLAB,] = (rows, round_up(max(ring_elems(cfg, spare), 1), cell // esize)), dtype
        self.arena, views = _carve(shapes, cell, self.device)
        self.cell_rows = self.arena.view(-1, cell // self.arena.element_size())  # [cells, words]

        self.groups: dict[str, PoolGroup] = {}
        for lg in layer_groups:
            n = pages[lg.name] + 1
            self.groups[lg.name] = PoolGroup(
                name=lg.name,
                layers=lg.layers,
                ratio=lg.ratio,
                num_pages=n,
                allocator=PageAllocator(n),
                kv={i: views[lg.name, "kv", i] for i in lg.layers},
                index_k={i: views[lg.name, "index_k", i] for i in lg.layers} if lg.indexed else {},
            )
        self.group_of_layer = {i: g.name for g in self.groups.values() for i in g.layers}
        self.slab = PageAllocator(seqs)
        # Rows seqs.. hold checkpoints of the prefix cache: a request's rings at a cached position
        self.checkpoint_slab = PageAllocator(kv_cfg.checkpoint_rows, first=seqs)
        self.slab_rows = views[SLAB,]  # [rows, row]: every ring of one request, padded to cells
        # Padding rows of a captured decode batch read and write a dummy page and slab row
        # that no request ever owns.
        self.dummy_pages = {g: grp.allocator.allocate(1)[0] for g, grp in self.groups.items()}
        self.dummy_slab = self.slab.allocate(1)[0]
        # Device copies of every request's page tables, one row per slab row, written when
        # pages are allocated: a step gathers its rows on the device instead of rebuilding
        # [batch, pages] tables on the host each step (that would cost O(context) per step).
        max_context = max_context or cfg.max_position_embeddings
        # The writes to them since the runner last took them, kept (not None) where the other
        # ranks of a tensor-parallel group replay them on their own copies.
        self.table_writes: list[tuple[int, str, int, list[int]]] | None = None
        self.page_tables = {
            g: torch.full(
                # (speculative decoding writes up to 2 K positions past a request's tokens)
                (seqs, min(grp.num_pages, self.pages_for(g, max_context + 2 * spare))),
                self.dummy_pages[g],
                dtype=torch.int32,
                device=self.device,
            )
            for g, grp in self.groups.items()
        }
        # Compressor rings, per layer: raw (kv, gate) projections of the most recent tokens,
        # the layer's main compressor's in comp_ring, its indexer's in index_ring.
        self.comp_ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        at = 0
        for ring in cfg.compressor_rings():
            pair = []
            ring_rows = ring.rows + spare
            for _ in ("kv", "gate"):
                size = ring_rows * ring.features
                pair.append(self.slab_rows[:, at : at + size].view(rows, ring_rows, ring.features))
                at += size
            target = self.index_ring if ring.name == "index" else self.comp_ring
            target[ring.layer] = (pair[0], pair[1])
        self.staging = KVStaging(outbox, block, cell, self.arena.dtype, self.device)
        # Per group (in `regions()` order, a group's regions being adjacent there): the cell
        # each of its regions starts at, and how many cells a page of it spans.
        base, runs = self.arena.data_ptr(), dict[str, list[tuple[int, int]]]()
        for r in self.regions():
            if r.group != STAGING:
                first, per = (r.tensor.data_ptr() - base) // cell, r.tensor[0].nbytes // cell
                runs.setdefault(r.group, []).append((first, per))
        self._page_cells = {g: np.array(rs, np.int64).T for g, rs in runs.items()}  # [2, regions]

    # ---------------------------------------------------------------- capacity

    def pages_for(self, group: str, num_tokens: int) -> int:
        """Pages a request of `num_tokens` computed tokens holds in `group`."""
        ratio = self.groups[group].ratio
        entries = num_tokens // ratio if ratio else 0
        return self.ring_pages + math.ceil(entries / self.page_size)

    def write_page_table(self, slab: int, group: str, first: int, pages: list[int]) -> None:
        """Record pages[i] as page `first + i` of the request in slab row `slab`."""
        table = self.page_tables[group]
        # (through pinned memory: a pageable copy would wait for the step the device runs)
        table[slab, first : first + len(pages)] = to_device(pages, torch.int32, table.device)
        if self.table_writes is not None:
            self.table_writes.append((slab, group, first, pages))

    def entry_slot_base(self, group: str) -> int:
        """First scratch row of every `kv[layer]` of `group` (rows before it are pages)."""
        return self.groups[group].num_pages * self.page_size

    def trash_slot(self, group: str) -> int:
        return self.entry_slot_base(group) + self.scratch_rows

    def index_trash_slot(self, group: str) -> int:
        """The trash row of every `index_k[layer]` of `group`."""
        return self.groups[group].num_pages * self.page_size

    def pages_of(self, t: torch.Tensor, num_pages: int) -> torch.Tensor:
        """The first num_pages pages of a layer's pool `t` (kv or index_k), viewed as [pages,
        ...]: [pages, P, D] rows, or an FP8 pool's [pages, P * bytes a row] as it is (what
        the indexer reads and NIXL registers)."""
        return (
            t[:num_pages]
            if self.fp8
            else t[: num_pages * self.page_size].view(num_pages, self.page_size, -1)
        )

    def write(self, target: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [N, D] into slots [N] of a layer's pool (kv or index_k), quantized on write when
        the pools are FP8 (kernels.store_rows)."""
        kernels.store_rows(target, slots, rows, self.page_size)

    def token_capacity(self) -> int:
        """Most computed tokens one request can hold, limited by the smallest group."""
        cap = 1 << 62
        for g in self.groups.values():
            usable = g.num_pages - 1
            if g.ratio:
                cap = min(cap, (usable - self.ring_pages) * self.page_size * g.ratio + g.ratio - 1)
            elif usable < self.ring_pages:
                cap = 0
        return cap

    @property
    def num_free_pages(self) -> int:
        """Free pages of every group, staging blocks included (a staged request holds those)."""
        return sum(g.allocator.num_free for g in self.groups.values()) + self.staging.num_free

    @property
    def num_total_pages(self) -> int:
        """Pages requests can own (the dummy pages and the staging ring excluded)."""
        return sum(g.num_pages - 1 for g in self.groups.values()) + self.staging.num_total

    # ---------------------------------------------------------------- transfer / layout

    def regions(self) -> list[PoolRegion]:
        """Every tensor a peer may read, viewed as [pages, ...]; all but the staging blocks, in
        this order, are what a request's KV state is made of (`cells`)."""
        out = []
        for g in self.groups.values():
            for i in g.layers:
                out.append(
                    PoolRegion(f"{g.name}.{i}.kv", g.name, self.pages_of(g.kv[i], g.num_pages))
                )
                if i in g.index_k:
                    out.append(
                        PoolRegion(
                            f"{g.name}.{i}.index_k",
                            g.name,
                            self.pages_of(g.index_k[i], g.num_pages),
                        )
                    )
        out.append(PoolRegion(SLAB, SLAB, self.slab_rows))
        out.append(PoolRegion(STAGING, STAGING, self.staging.blocks))
        return out

    def cells(self, pages: Mapping[str, Sequence[int]]) -> np.ndarray:
        """The arena cells of pages, region by region (in `regions()` order), each region's
        pages in the order given: what the prefix cache's copies and the host tier move
        (a request's transfer order is `stream`'s). [n] int64.

        pages: group -> page ids, slab rows under "slab"; a group left out adds nothing."""
        parts = []
        for group, (first, per) in self._page_cells.items():
            ids = np.asarray(pages.get(group, ()), dtype=np.int64)
            # Runs of cells, region-major: run (r, i) starts at first[r] + ids[i] * per[r].
            starts = (first[:, None] + ids[None, :] * per[:, None]).ravel()  # [regions * n]
            lengths = np.repeat(per, ids.size)
            skip = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each cell's run offset
            parts.append(np.repeat(starts, lengths) + np.arange(lengths.sum()) - skip)
        return np.concatenate(parts)

    def stream(self, pages: Mapping[str, Sequence[int]], skip: int = 0) -> np.ndarray:
        """The arena cells of a request's KV state in transfer order, what staging packs and a
        pull unpacks: its slab row, each group's window ring pages, then its entry pages from
        the newest to the oldest (by the position each page's entries end at; ties in group
        order), a page's regions together. [n] int64.

        Why newest first: a reader that already holds a prefix's full entry pages (a decode
        worker's cache, `missing`) lacks exactly those ending past the prefix, so what it
        pulls is the start of the stream: `skip` leaves out the pages of the first `skip`
        tokens, and the rest is a prefix of the whole.

        pages: group -> page ids in page-table order (ring pages, then entry pages), the slab
        row under "slab" (as `Handoff.held_pages`)."""
        units: list[tuple[int, int, int, int]] = []  # (-end, group order, page order, page id)
        order = list(self._page_cells)
        for rank, group in enumerate(order):
            table = list(pages.get(group, ()))
            if group == SLAB:
                units += [(-(1 << 62), rank, k, i) for k, i in enumerate(table)]
                continue
            ring, ratio = self.ring_pages, self.groups[group].ratio
            units += [(-(1 << 61), rank, k, i) for k, i in enumerate(table[:ring])]
            for k, i in enumerate(table[ring:]):
                end = (k + 1) * self.page_size * ratio
                if end > skip:
                    units.append((-end, rank, k, i))
        units.sort()
        ids = np.array([u[3] for u in units], dtype=np.int64)
        groups = np.array([u[1] for u in units], dtype=np.int64)
        # Runs of cells, unit by unit and in each unit region by region: run (u, r) starts at
        # first[r] + ids[u] * per[r] of the unit's group.
        runs = np.array([self._page_cells[g].shape[1] for g in order], np.int64)[groups]
        at = np.cumsum(runs) - runs  # each unit's first run
        starts, lengths = np.zeros((2, int(runs.sum())), np.int64)
        for rank, group in enumerate(order):
            first, per = self._page_cells[group]
            mine = np.flatnonzero(groups == rank)
            slots = at[mine, None] + np.arange(per.size)[None, :]  # [units, regions]
            starts[slots] = first[None, :] + ids[mine, None] * per[None, :]
            lengths[slots] = per[None, :]
        offset = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each cell's run offset
        return np.repeat(starts, lengths) + np.arange(lengths.sum()) - offset

    def missing(self, pages: Mapping[str, Sequence[int]], skip: int) -> dict[str, list[int]]:
        """A request's pages (as `stream` takes them) but the full entry pages of its first
        `skip` tokens, which a reader sharing them from its own cache already holds."""
        out: dict[str, list[int]] = {}
        for group, ids in pages.items():
            ratio = self.groups[group].ratio if group in self.groups else 0
            held = (skip // ratio) // self.page_size if ratio else 0
            ring = self.ring_pages if group in self.groups else 0
            out[group] = [*ids[:ring], *ids[ring + held :]]
        return out

    def stream_bytes(self, pages: Mapping[str, Sequence[int]]) -> int:
        """Bytes of a request's KV state: cells(pages).size * cell_bytes, without the cells."""
        cells = sum(
            len(pages.get(g, ())) * int(per.sum()) for g, (_, per) in self._page_cells.items()
        )
        return cells * self.cell_bytes

    def stage(self, pages: Mapping[str, Sequence[int]]) -> list[int] | None:
        """Pack a request's KV state into free staging blocks, in `stream` order (see
        KVStaging.stage)."""
        return self.staging.stage(self.cell_rows, self.stream(pages))

    def unpacker(self, pages: Mapping[str, Sequence[int]], skip: int = 0) -> Unpacker:
        """What scatters a pulled stream (its first part, where `skip` leaves out the reader's
        own pages: `stream`) into these pages (see KVStaging.unpacker)."""
        nbytes = self.stream_bytes(self.missing(pages, skip))
        return self.staging.unpacker(self.cell_rows, nbytes, lambda: self.stream(pages, skip))

    def layout(self) -> dict:
        """What must agree between two workers for their pages to be interchangeable."""
        return {
            "version": 3,  # 3: the `stream` order, newest pages first
            "family": self.cfg.family,
            "dtype": str(self.dtype).removeprefix("torch."),
            # how rows are stored: a bf16 and an FP8 worker must never pair (their region
            # shapes differ too; this names why)
            "kv_cache_dtype": self.kv_cache_dtype,
            "page_size": self.page_size,
            "ring_len": self.ring_len,
            **self.cfg.kv_layout_fields(),
            "head_dim": self.cfg.head_dim,
            "index_head_dim": self.cfg.index_head_dim,
            "regions": [[r.name, r.group, list(r.tensor.shape[1:])] for r in self.regions()],
        }

    def layout_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.layout(), sort_keys=True).encode()).hexdigest()[:16]

    def layout_description(self) -> str:
        counts = ", ".join(f"{g.name}: {len(g.layers)} layers" for g in self.groups.values())
        return (
            f"{self.layout_hash()} ({self.cfg.family}, dtype={self.layout()['dtype']}, "
            f"kv_cache_dtype={self.kv_cache_dtype}, page_size={self.page_size}, "
            f"ring={self.ring_len}, head_dim={self.cfg.head_dim}, {counts}, staging block "
            f"{self.staging.block_bytes / 2**20:.2f} MiB)"
        )


def _carve(
    shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]], align: int, device: torch.device
) -> tuple[torch.Tensor, dict[tuple, torch.Tensor]]:
    """One zeroed allocation and a contiguous view of each (shape, dtype) inside it, each at a
    multiple of `align` bytes. Returns (the allocation as words [n], views by key)."""
    offsets, size = {}, 0
    for key, (shape, dtype) in shapes.items():
        offsets[key] = size
        size += round_up(math.prod(shape) * element_size(dtype), align)
    word = next(
        w
        for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if align % element_size(w) == 0
    )
    arena = memory.zeros(size // element_size(word), word, device)
    raw = arena.view(torch.uint8)
    views = {
        key: raw[offsets[key] : offsets[key] + math.prod(shape) * element_size(dtype)]
        .view(dtype)
        .view(shape)
        for key, (shape, dtype) in shapes.items()
    }
    return arena, views
