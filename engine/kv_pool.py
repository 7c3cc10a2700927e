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

Small per-request state (each compressor's ring of recent raw projections) lives in the slab:
one row per running request, each layer's rings a view into it.

Every pool is a view into ONE zeroed allocation, the arena, at an offset that is a multiple of
the cell size (the largest size dividing every page). So each page of any pool, and each slab
row, is a run of whole cells, and a request's KV state is a list of cells (`cells`): what the
staging buffer (engine.kv_staging) gathers and scatters with one indexed copy. Each layer's pool
is still a contiguous [slots, D] tensor, what the kernels read, so a decode step does not change.
`regions()` lists what NIXL registers, `layout()` describes it and `layout_hash()` identifies it
across workers.

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
bytes, so the same --kv-cache-memory-bytes holds ~1.77x (the built-in model) to ~1.79x
(V4-Flash) the tokens of bf16 pages (`bytes_per_token`).
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

import kernels
from engine.async_copy import to_device
from engine.kv_staging import KVStaging, Unpacker
from engine.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from engine.page_allocator import PageAllocator
from kernels.kv_quant import KV_DIM, KV_ROPE, KV_TOKEN_BYTES, index_token_bytes

GROUP_OF_KIND = {SLIDING: "swa", CSA: "csa", HCA: "hca"}
SLAB = "slab"
STAGING = "staging"
STAGING_SHARE = 16  # by default staged requests get 1/16 of the budget left after fixed costs


class KVBudgetError(ValueError):
    """The memory budget cannot hold the requested pool shape."""


@dataclass(frozen=True)
class KVCacheConfig:
    memory_bytes: int  # budget for pages + slab + scratch + staged requests
    page_size: int = 64  # entries (window rows or compressed entries) per page
    max_num_seqs: int = 256  # slab rows = requests that can hold KV at once
    max_num_batched_tokens: int = 8192  # rows one forward step may compute (scratch rows)
    staging_bytes: int | None = None  # for staged requests (None: see STAGING_SHARE)
    kv_cache_dtype: str = "auto"  # "auto": rows in the model dtype; "fp8": kernels.kv_quant pages

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"


def check_kv_cache_dtype(cfg: ModelConfig, kv_cache_dtype: str, page_size: int) -> None:
    """Raise ValueError, saying what to change, when the pools cannot take `kv_cache_dtype`."""
    if kv_cache_dtype == "auto":
        return
    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    if cfg.head_dim != KV_DIM or cfg.rope_dim != KV_ROPE:
        raise ValueError(
            f"--kv-cache-dtype fp8 stores DeepSeek-V4's {KV_DIM}-wide KV rows ({KV_DIM - KV_ROPE} "
            f"e4m3 + {KV_ROPE} bf16 RoPE values); this model has head_dim {cfg.head_dim} with "
            f"{cfg.rope_dim} RoPE dims: use --kv-cache-dtype auto"
        )
    if page_size % 4:
        raise ValueError(
            f"--kv-cache-dtype fp8 needs a --block-size that is a multiple of 4 (FP8 pages stay "
            f"16-byte aligned), got {page_size}"
        )
    di = cfg.index_head_dim
    if cfg.layers_of(CSA) and (di < 16 or di & (di - 1)):
        raise ValueError(
            f"--kv-cache-dtype fp8 stores index keys of a power-of-two width >= 16; this model's "
            f"index_head_dim is {di}: use --kv-cache-dtype auto"
        )


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
    # layer -> [num_pages * P + scratch + 1, head_dim]; FP8: uint8 [pages, P * 584], the pages
    # past num_pages holding the scratch and trash rows
    kv: dict[int, torch.Tensor]
    # CSA layer -> [num_pages * P + 1, index_head_dim]; FP8: uint8 [num_pages + 1, P * (Di + 4)]
    index_k: dict[int, torch.Tensor]


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
        self.scratch_rows = S = kv_cfg.max_num_batched_tokens
        check_kv_cache_dtype(cfg, kv_cfg.kv_cache_dtype, P)
        self.fp8 = fp8 = kv_cfg.fp8
        # what a cached row is stored as (the layout names it): "fp8" or the model dtype
        self.kv_cache_dtype = "fp8" if fp8 else str(dtype).removeprefix("torch.")
        esize = _esize(dtype)
        layer_kinds = {
            GROUP_OF_KIND[k]: (k, tuple(cfg.layers_of(k)))
            for k in (SLIDING, CSA, HCA)
            if cfg.layers_of(k)
        }
        self.cell_bytes = cell = cell_bytes(cfg, P, esize, fp8)
        block = staging_block_bytes(cfg, P, esize, fp8)
        pages, outbox = plan_pages(cfg, kv_cfg, esize, block)

        seqs = kv_cfg.max_num_seqs + 1
        shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, (kind, layers) in layer_kinds.items():
            n = pages[name] + 1  # + one dummy page (below)
            for i in layers:
                if fp8:  # scratch + trash rows in whole pages; the index trash row in one more
                    pages_kv = n + _scratch_pages(P, S)
                    shapes[name, "kv", i] = (pages_kv, P * KV_TOKEN_BYTES), torch.uint8
                    if kind == CSA:
                        width = P * index_token_bytes(cfg.index_head_dim)
                        shapes[name, "index_k", i] = (n + 1, width), torch.uint8
                else:
                    shapes[name, "kv", i] = (n * P + S + 1, cfg.head_dim), dtype
                    if kind == CSA:
                        shapes[name, "index_k", i] = (n * P + 1, cfg.index_head_dim), dtype
        shapes[SLAB,] = (seqs, _round_up(max(_ring_elems(cfg), 1), cell // esize)), dtype
        self.arena, views = _carve(shapes, cell, self.device)
        self.cell_rows = self.arena.view(-1, cell // self.arena.element_size())  # [cells, words]

        self.groups: dict[str, PoolGroup] = {}
        for name, (kind, layers) in layer_kinds.items():
            n = pages[name] + 1
            self.groups[name] = PoolGroup(
                name=name,
                layers=layers,
                ratio=cfg.compress_rate(layers[0]),
                num_pages=n,
                allocator=PageAllocator(n),
                kv={i: views[name, "kv", i] for i in layers},
                index_k={i: views[name, "index_k", i] for i in layers} if kind == CSA else {},
            )
        self.group_of_layer = [GROUP_OF_KIND[k] for k in cfg.layer_types]
        self.slab = PageAllocator(seqs)
        self.slab_rows = views[SLAB,]  # [seqs, row]: every ring of one request, padded to cells
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
                (seqs, min(grp.num_pages, self.pages_for(g, max_context))),
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
        at = 0
        for i in range(cfg.num_layers):
            for ring, width in _compressor_rings(cfg, i):
                rows, feats = ring_shape(cfg, i, width)
                pair = []
                for _ in ("kv", "gate"):
                    pair.append(self.slab_rows[:, at : at + rows * feats].view(seqs, rows, feats))
                    at += rows * feats
                target = self.comp_ring if ring == "comp" else self.index_ring
                target[i] = (pair[0], pair[1])
        self.staging = KVStaging(outbox, block, cell, self.arena.dtype, self.device)
        # Per group (in `regions()` order, a group's regions being adjacent there): the cell
        # each of its regions starts at, and how many cells a page of it spans.
        base, runs = self.arena.data_ptr(), {}
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

    def index_trash_slot(self) -> int:
        return self.groups["csa"].num_pages * self.page_size

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
        """The arena cells of a request's KV state in stream order: region by region (in
        `regions()` order), the request's pages in its page-table order. [n] int64.

        pages: group -> page ids, the slab row under "slab" (as `LLMEngine.held_pages`)."""
        parts = []
        for group, (first, per) in self._page_cells.items():
            ids = np.asarray(pages[group], dtype=np.int64)
            # Runs of cells, region-major: run (r, i) starts at first[r] + ids[i] * per[r].
            starts = (first[:, None] + ids[None, :] * per[:, None]).ravel()  # [regions * n]
            lengths = np.repeat(per, ids.size)
            skip = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each cell's run offset
            parts.append(np.repeat(starts, lengths) + np.arange(lengths.sum()) - skip)
        return np.concatenate(parts)

    def stream_bytes(self, pages: Mapping[str, Sequence[int]]) -> int:
        """Bytes of a request's KV state: cells(pages).size * cell_bytes, without the cells."""
        cells = sum(len(pages[g]) * int(per.sum()) for g, (_, per) in self._page_cells.items())
        return cells * self.cell_bytes

    def stage(self, pages: Mapping[str, Sequence[int]]) -> list[int] | None:
        """Pack a request's KV state into free staging blocks (see KVStaging.stage)."""
        return self.staging.stage(self.cell_rows, self.cells(pages))

    def unpacker(self, pages: Mapping[str, Sequence[int]]) -> Unpacker:
        """What scatters a pulled stream into these pages (see KVStaging.unpacker)."""
        return self.staging.unpacker(
            self.cell_rows, self.stream_bytes(pages), lambda: self.cells(pages)
        )

    def layout(self) -> dict:
        """What must agree between two workers for their pages to be interchangeable."""
        return {
            "version": 2,  # 2: one slab region, the staging blocks, the stream order of `cells`
            "dtype": str(self.dtype).removeprefix("torch."),
            # how rows are stored: a bf16 and an FP8 worker must never pair (their region
            # shapes differ too; this names why)
            "kv_cache_dtype": self.kv_cache_dtype,
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
            f"{self.layout_hash()} (dtype={self.layout()['dtype']}, kv_cache_dtype="
            f"{self.kv_cache_dtype}, page_size={self.page_size}, "
            f"ring={self.ring_len}, head_dim={self.cfg.head_dim}, {counts}, staging block "
            f"{self.staging.block_bytes / 2**20:.2f} MiB)"
        )


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_bytes(cfg: ModelConfig, esize: int, fp8: bool = False) -> tuple[int, int]:
    """Bytes of one cached row: (attention entry or window row, index key); model-dtype rows of
    esize-byte elements, or kernels.kv_quant's FP8 rows (584, Di + 4)."""
    if fp8:
        return KV_TOKEN_BYTES, index_token_bytes(cfg.index_head_dim)
    return cfg.head_dim * esize, cfg.index_head_dim * esize


def bytes_per_token(cfg: ModelConfig, esize: int, fp8: bool = False) -> float:
    """KV bytes one more token of context costs a request (every layer, past its fixed window
    and ring): what a budget's spare bytes are divided by (plan_pages). The FP8 / bf16
    capacity ratio is bytes_per_token(cfg, 2) / bytes_per_token(cfg, 2, fp8=True)."""
    kv, index = row_bytes(cfg, esize, fp8)
    return sum(
        (kv + (index if kind == CSA else 0)) / cfg.compress_rate(i)
        for i, kind in enumerate(cfg.layer_types)
        if cfg.compress_rate(i)
    )


def _scratch_pages(page_size: int, scratch_rows: int) -> int:
    """Pages an FP8 pool spends on its scratch rows and its trash row."""
    return -(-(scratch_rows + 1) // page_size)


def _page_bytes(
    cfg: ModelConfig, page_size: int, esize: int, fp8: bool = False
) -> dict[str, list[int]]:
    """group -> bytes of one page in each of its layers' pools."""
    kv, index = row_bytes(cfg, esize, fp8)
    out: dict[str, list[int]] = {}
    for kind in cfg.layer_types:
        pools = out.setdefault(GROUP_OF_KIND[kind], [])
        pools.append(page_size * kv)
        if kind == CSA:
            pools.append(page_size * index)
    return out


def cell_bytes(cfg: ModelConfig, page_size: int, esize: int, fp8: bool = False) -> int:
    """The largest size that divides every page of every pool (FP8 at P = 64: 256 bytes, where
    bf16 pages give 16 KiB)."""
    pages = _page_bytes(cfg, page_size, esize, fp8)
    return math.gcd(*(b for pools in pages.values() for b in pools))


def staging_block_bytes(cfg: ModelConfig, page_size: int, esize: int, fp8: bool = False) -> int:
    """Bytes of one staging block: a page of the largest group, every layer of it (1.6 MB on
    V4-Flash in bf16, 0.9 MB in FP8). Depends only on the layout, so workers with different
    budgets agree on it."""
    return max(sum(pools) for pools in _page_bytes(cfg, page_size, esize, fp8).values())


def _carve(
    shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]], align: int, device: torch.device
) -> tuple[torch.Tensor, dict[tuple, torch.Tensor]]:
    """One zeroed allocation and a contiguous view of each (shape, dtype) inside it, each at a
    multiple of `align` bytes. Returns (the allocation as words [n], views by key)."""
    offsets, size = {}, 0
    for key, (shape, dtype) in shapes.items():
        offsets[key] = size
        size += _round_up(math.prod(shape) * _esize(dtype), align)
    word = next(
        w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if align % _esize(w) == 0
    )
    arena = torch.zeros(size // _esize(word), dtype=word, device=device)
    raw = arena.view(torch.uint8)
    views = {
        key: raw[offsets[key] : offsets[key] + math.prod(shape) * _esize(dtype)]
        .view(dtype)
        .view(shape)
        for key, (shape, dtype) in shapes.items()
    }
    return arena, views


def _ring_elems(cfg: ModelConfig) -> int:
    """Elements of every compressor ring of one request: what a slab row holds."""
    return sum(
        2 * math.prod(ring_shape(cfg, i, width))
        for i in range(cfg.num_layers)
        for _, width in _compressor_rings(cfg, i)
    )


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


def plan_pages(
    cfg: ModelConfig, kv_cfg: KVCacheConfig, esize: int, block_bytes: int
) -> tuple[dict[str, int], int]:
    """Split the budget so every group can hold the same total number of tokens; returns
    (pages per group, staging blocks for staged requests).

    Fixed costs (scratch, slab rows, each sequence's ring pages plus one partial page per
    compressed group) come first. Of the rest, staged requests get `staging_bytes` (default
    1/STAGING_SHARE of it; the ring pulls land in is not part of the budget), and what is left
    buys token capacity C: a compressed group with rate r gets C / r / P more pages.
    """
    P, S, B = kv_cfg.page_size, kv_cfg.max_num_seqs, kv_cfg.max_num_batched_tokens
    ring_pages = math.ceil(cfg.sliding_window / P)
    kv_row, index_row = row_bytes(cfg, esize, kv_cfg.fp8)
    fixed, per_token, pages = 0.0, 0.0, {}
    for kind in (SLIDING, CSA, HCA):
        layers = cfg.layers_of(kind)
        if not layers:
            continue
        row = kv_row + (index_row if kind == CSA else 0)
        page_bytes = P * row * len(layers)
        ratio = cfg.compress_rate(layers[0])
        base_pages = S * (ring_pages + (1 if ratio else 0))
        pages[GROUP_OF_KIND[kind]] = (base_pages, ratio)
        if kv_cfg.fp8:  # scratch + trash rows in whole pages, the index trash row in a page
            extra = _scratch_pages(P, B) * P * kv_row + (P * index_row if kind == CSA else 0)
        else:
            extra = (B + 2) * row
        fixed += base_pages * page_bytes + extra * len(layers)
        if ratio:
            per_token += page_bytes / (ratio * P)
    for i in range(cfg.num_layers):
        for _, width in _compressor_rings(cfg, i):
            rows, feats = ring_shape(cfg, i, width)
            fixed += 2 * S * rows * feats * esize
    spare = kv_cfg.memory_bytes - fixed
    staging = kv_cfg.staging_bytes
    staging = max(0, int(spare)) // STAGING_SHARE if staging is None else staging
    if spare - staging <= 0:
        raise KVBudgetError(
            f"KV cache budget of {kv_cfg.memory_bytes / 2**20:.1f} MiB is below the fixed cost of "
            f"{fixed / 2**20:.1f} MiB (plus {staging / 2**20:.1f} MiB for staged requests) for "
            f"max_num_seqs={S} and max_num_batched_tokens={kv_cfg.max_num_batched_tokens}; "
            "raise --kv-cache-memory-bytes or lower those limits"
        )
    capacity = int((spare - staging) / per_token) if per_token else 0
    plan = {
        g: base + (math.ceil(capacity / ratio / P) if ratio else 0)
        for g, (base, ratio) in pages.items()
    }
    return plan, staging // block_bytes
