"""Preallocated, paged KV state of DeepSeek-V4, sized up front from a memory budget.

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
chunk before they are persisted to the ring) and one trash row that absorbs writes which
must not land anywhere (keeps the decode step free of data-dependent shapes).

Small per-request state (each compressor's ring of recent raw projections) lives in a slab:
one row per running request. Every tensor here is plain and contiguous so NIXL can register
it; `layout()` describes it and `layout_hash()` identifies it across workers.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from engine.page_allocator import PageAllocator

GROUP_OF_KIND = {SLIDING: "swa", CSA: "csa", HCA: "hca"}
SLAB = "slab"


class KVBudgetError(ValueError):
    """The memory budget cannot hold the requested pool shape."""


@dataclass(frozen=True)
class KVCacheConfig:
    memory_bytes: int  # budget for pages + slab + scratch
    page_size: int = 64  # entries (window rows or compressed entries) per page
    max_num_seqs: int = 256  # slab rows = requests that can hold KV at once
    max_num_batched_tokens: int = 8192  # rows one forward step may compute (scratch rows)


class PoolRegion(NamedTuple):
    """One registrable tensor: dim 0 indexes the pages of `group` (slab rows for "slab")."""

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
    kv: dict[int, torch.Tensor]  # layer -> [num_pages * P + scratch + 1, head_dim]
    index_k: dict[int, torch.Tensor]  # CSA layer -> [num_pages * P + 1, index_head_dim]


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        kv_cfg: KVCacheConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int | None = None,
    ) -> None:
        self.cfg, self.kv_cfg, self.dtype, self.device = cfg, kv_cfg, dtype, torch.device(device)
        self.page_size = P = kv_cfg.page_size
        self.ring_pages = math.ceil(cfg.sliding_window / P)
        self.ring_len = self.ring_pages * P
        self.scratch_rows = kv_cfg.max_num_batched_tokens
        layer_kinds = {
            GROUP_OF_KIND[k]: (k, tuple(cfg.layers_of(k)))
            for k in (SLIDING, CSA, HCA)
            if cfg.layers_of(k)
        }
        pages = plan_pages(cfg, kv_cfg, _esize(dtype))
        self.groups: dict[str, PoolGroup] = {}
        for name, (kind, layers) in layer_kinds.items():
            n = pages[name] + 1  # + one dummy page (below)
            self.groups[name] = PoolGroup(
                name=name,
                layers=layers,
                ratio=cfg.compress_rate(layers[0]),
                num_pages=n,
                allocator=PageAllocator(n),
                kv={i: self._zeros(n * P + self.scratch_rows + 1, cfg.head_dim) for i in layers},
                index_k={i: self._zeros(n * P + 1, cfg.index_head_dim) for i in layers}
                if kind == CSA
                else {},
            )
        self.group_of_layer = [GROUP_OF_KIND[k] for k in cfg.layer_types]
        self.slab = PageAllocator(kv_cfg.max_num_seqs + 1)
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
                (kv_cfg.max_num_seqs + 1, min(grp.num_pages, self.pages_for(g, max_context))),
                self.dummy_pages[g],
                dtype=torch.int32,
                device=self.device,
            )
            for g, grp in self.groups.items()
        }
        # Compressor rings, per layer: raw (kv, gate) projections of the most recent tokens.
        # Overlapping (CSA) compressors keep two windows, the others one.
        self.comp_ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(cfg.num_layers):
            for ring, width in _compressor_rings(cfg, i):
                rows, feats = ring_shape(cfg, i, width)
                target = self.comp_ring if ring == "comp" else self.index_ring
                target[i] = (
                    self._zeros(kv_cfg.max_num_seqs + 1, rows, feats),
                    self._zeros(kv_cfg.max_num_seqs + 1, rows, feats),
                )

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    # ---------------------------------------------------------------- capacity

    def pages_for(self, group: str, num_tokens: int) -> int:
        """Pages a request of `num_tokens` computed tokens holds in `group`."""
        ratio = self.groups[group].ratio
        entries = num_tokens // ratio if ratio else 0
        return self.ring_pages + math.ceil(entries / self.page_size)

    def write_page_table(self, slab: int, group: str, first: int, pages: list[int]) -> None:
        """Record pages[i] as page `first + i` of the request in slab row `slab`."""
        self.page_tables[group][slab, first : first + len(pages)] = torch.tensor(
            pages, dtype=torch.int32
        )
        if self.table_writes is not None:
            self.table_writes.append((slab, group, first, pages))

    def entry_slot_base(self, group: str) -> int:
        """First scratch row of every `kv[layer]` of `group` (rows before it are pages)."""
        return self.groups[group].num_pages * self.page_size

    def trash_slot(self, group: str) -> int:
        return self.entry_slot_base(group) + self.scratch_rows

    def index_trash_slot(self) -> int:
        return self.groups["csa"].num_pages * self.page_size

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
        return sum(g.allocator.num_free for g in self.groups.values())

    @property
    def num_total_pages(self) -> int:
        """Pages requests can own (the dummy pages excluded)."""
        return sum(g.num_pages - 1 for g in self.groups.values())

    # ---------------------------------------------------------------- transfer / layout

    def regions(self) -> list[PoolRegion]:
        """Every tensor a peer must copy to move a request, viewed as [pages, ...]."""
        P, out = self.page_size, []
        for g in self.groups.values():
            for i in g.layers:
                out.append(
                    PoolRegion(
                        f"{g.name}.{i}.kv",
                        g.name,
                        g.kv[i][: g.num_pages * P].view(g.num_pages, P, -1),
                    )
                )
                if i in g.index_k:
                    out.append(
                        PoolRegion(
                            f"{g.name}.{i}.index_k",
                            g.name,
                            g.index_k[i][: g.num_pages * P].view(g.num_pages, P, -1),
                        )
                    )
        for name, rings in (("comp", self.comp_ring), ("index", self.index_ring)):
            for i, (kv, gate) in rings.items():
                out.append(PoolRegion(f"{SLAB}.{i}.{name}_kv", SLAB, kv))
                out.append(PoolRegion(f"{SLAB}.{i}.{name}_gate", SLAB, gate))
        return out

    def layout(self) -> dict:
        """What must agree between two workers for their pages to be interchangeable."""
        return {
            "version": 1,
            "dtype": str(self.dtype).removeprefix("torch."),
            "page_size": self.page_size,
            "ring_len": self.ring_len,
            "layer_types": list(self.cfg.layer_types),
            "compress_rates": self.cfg.compress_rates,
            "head_dim": self.cfg.head_dim,
            "index_head_dim": self.cfg.index_head_dim,
            "regions": [[r.name, r.group, list(r.tensor.shape[1:])] for r in self.regions()],
        }

    def layout_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.layout(), sort_keys=True).encode()).hexdigest()[:16]

    def layout_description(self) -> str:
        counts = ", ".join(f"{g.name}: {len(g.layers)} layers" for g in self.groups.values())
        return (
            f"{self.layout_hash()} (dtype={self.layout()['dtype']}, page_size={self.page_size}, "
            f"ring={self.ring_len}, head_dim={self.cfg.head_dim}, {counts})"
        )


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _compressor_rings(cfg: ModelConfig, layer: int) -> list[tuple[str, int]]:
    kind = cfg.layer_types[layer]
    if kind == CSA:
        return [("comp", cfg.head_dim), ("index", cfg.index_head_dim)]
    if kind == HCA:
        return [("comp", cfg.head_dim)]
    return []


def ring_shape(cfg: ModelConfig, layer: int, head_dim: int) -> tuple[int, int]:
    """(rows, features) of a compressor ring: CSA keeps 2 windows of [Ca | Cb] features."""
    rate = cfg.compress_rate(layer)
    overlap = cfg.layer_types[layer] == CSA
    return (2 * rate, 2 * head_dim) if overlap else (rate, head_dim)


def plan_pages(cfg: ModelConfig, kv_cfg: KVCacheConfig, esize: int) -> dict[str, int]:
    """Split the budget so every group can hold the same total number of tokens.

    Fixed costs (scratch, slab rows, each sequence's ring pages plus one partial page per
    compressed group) come first; the rest buys token capacity C, and a compressed group
    with rate r gets C / r / P more pages.
    """
    P, S = kv_cfg.page_size, kv_cfg.max_num_seqs
    ring_pages = math.ceil(cfg.sliding_window / P)
    fixed, per_token, pages = 0.0, 0.0, {}
    for kind in (SLIDING, CSA, HCA):
        layers = cfg.layers_of(kind)
        if not layers:
            continue
        row_bytes = cfg.head_dim * esize + (cfg.index_head_dim * esize if kind == CSA else 0)
        page_bytes = P * row_bytes * len(layers)
        ratio = cfg.compress_rate(layers[0])
        base_pages = S * (ring_pages + (1 if ratio else 0))
        pages[GROUP_OF_KIND[kind]] = (base_pages, ratio)
        fixed += base_pages * page_bytes + (kv_cfg.max_num_batched_tokens + 2) * row_bytes * len(
            layers
        )
        if ratio:
            per_token += page_bytes / (ratio * P)
    for i in range(cfg.num_layers):
        for _, width in _compressor_rings(cfg, i):
            rows, feats = ring_shape(cfg, i, width)
            fixed += 2 * S * rows * feats * esize
    spare = kv_cfg.memory_bytes - fixed
    if spare <= 0:
        raise KVBudgetError(
            f"KV cache budget of {kv_cfg.memory_bytes / 2**20:.1f} MiB is below the fixed cost of "
            f"{fixed / 2**20:.1f} MiB for max_num_seqs={S} and max_num_batched_tokens="
            f"{kv_cfg.max_num_batched_tokens}; raise --kv-cache-memory-bytes or lower those limits"
        )
    capacity = int(spare / per_token) if per_token else 0
    return {
        g: base + (math.ceil(capacity / ratio / P) if ratio else 0)
        for g, (base, ratio) in pages.items()
    }
