"""The KV pools' layout arithmetic, nothing allocated: what a row, a page, a cell, a staging
block and a slab row cost, and how a memory budget splits into pages (engine.kv.pool allocates
what this plans; bench/kv_cache_dtype.py reads capacities straight from here).

A model family describes its KV state through its config, a `KVModel`: the groups of layers
that each get a page allocator (`LayerGroup`), the compressor rings a request keeps in its slab
row (`Ring`), and the widths of its rows. Nothing here names a family; DeepSeek-V4's config is
one KVModel (window rings, compressed entries, compressor rings), DeepSeek-V3.2's another (one
group whose every token keeps a 576-wide latent row and an index key; no ring, no slab state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dsaserve.kernels.kv_quant import KV_DIM, KV_ROPE, V32_DIM, index_token_bytes, kv_token_bytes

SLAB = "slab"
STAGING = "staging"
STAGING_SHARE = 16  # by default staged requests get 1/16 of the budget left after fixed costs
CHECKPOINT_SHARE = 8  # prefix caching: checkpoints get 1/8 of the budget past the scratch rows
SEQUENCE_SHARE = 2  # sequences' fixed state: at most 1/2 of what scratch rows and checkpoints leave


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
    # checkpoints of the prefix cache (engine.prefix_cache.cache): each a slab row past the
    # requests' (compressor rings at a cached position) and a window ring's pages in every
    # group, a fixed cost of the budget
    checkpoint_rows: int = 0
    # speculative decoding's drafts per step: rejected drafts write rows past a request's
    # newest token, so its window ring and compressor rings keep this many rows more than they
    # need (what a later step reads is never overwritten by a rejected row)
    speculative_tokens: int = 0

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one attention kind: one page allocator, one page table per request."""

    name: str  # the pool group, as page tables and KV handles name it
    layers: tuple[int, ...]
    ratio: int  # tokens per compressed entry; 0 = window only
    indexed: bool  # its layers also keep the indexer's compressed keys (`index_k`)


@dataclass(frozen=True)
class Ring:
    """One compressor's ring in the slab row: raw (kv, gate) projections of its open windows."""

    layer: int
    name: str  # which of the layer's compressors ("comp", "index")
    rows: int
    features: int


class KVModel(Protocol):
    """What the KV pools ask of a model family (its config implements it)."""

    @property
    def family(self) -> str: ...  # its HF model_type: layouts of two families never pair

    @property
    def head_dim(self) -> int: ...  # width of a KV row (window row or compressed entry)

    @property
    def index_head_dim(self) -> int: ...  # width of an index key

    @property
    def rope_dim(self) -> int: ...  # RoPE dims at the end of a KV row (the FP8 rows keep bf16)

    @property
    def sliding_window(self) -> int: ...  # window rows a request keeps in its ring pages

    @property
    def needs_scratch_rows(self) -> bool: ...  # a step's rows wait in scratch rows (see pool)

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def kv_cache_dtypes(self) -> tuple[str, ...]: ...  # what --kv-cache-dtype may store

    @property
    def prefill_halo(self) -> int:
        """How many rows before a position whose state must be exact (a prompt's end, a prefix
        checkpoint) the family's prefill must compute in every layer; 0: it computes every row.
        The scheduler tells each chunk those positions up to this far past its end (RowSpan
        .anchors)."""
        ...

    @property
    def token_lookback(self) -> int: ...  # tokens before a chunk its rows read (RowSpan.lookback)

    def kv_groups(self) -> tuple[LayerGroup, ...]:
        """The pool groups, in pool order, each with its layers in order."""
        ...

    def compressor_rings(self) -> tuple[Ring, ...]:
        """Every ring of a slab row, in the order they sit in it."""
        ...

    def kv_layout_fields(self) -> dict[str, object]:
        """What the layout description names of the model beyond the widths (its layer kinds)."""
        ...


def check_kv_cache_dtype(model: KVModel, kv_cache_dtype: str, page_size: int) -> None:
    """Raise ValueError, saying what to change, when the pools cannot take `kv_cache_dtype`."""
    if kv_cache_dtype == "auto":
        return
    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    if kv_cache_dtype not in model.kv_cache_dtypes:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is not served for {model.family} (its KV formats "
            "are not implemented here): use --kv-cache-dtype auto"
        )
    if model.head_dim not in (KV_DIM, V32_DIM) or model.rope_dim != KV_ROPE:
        raise ValueError(
            f"--kv-cache-dtype fp8 stores DeepSeek-V4's {KV_DIM}-wide KV rows ({KV_DIM - KV_ROPE} "
            f"e4m3 + {KV_ROPE} bf16 RoPE values) and DeepSeek-V3.2's {V32_DIM}-wide ones "
            f"({V32_DIM - KV_ROPE} + {KV_ROPE}); this model has head_dim {model.head_dim} with "
            f"{model.rope_dim} RoPE dims: use --kv-cache-dtype auto"
        )
    if page_size % 4:
        raise ValueError(
            f"--kv-cache-dtype fp8 needs a --block-size that is a multiple of 4 (FP8 pages stay "
            f"16-byte aligned), got {page_size}"
        )
    di = model.index_head_dim
    if any(g.indexed for g in model.kv_groups()) and (di < 16 or di & (di - 1)):
        raise ValueError(
            f"--kv-cache-dtype fp8 stores index keys of a power-of-two width >= 16; this model's "
            f"index_head_dim is {di}: use --kv-cache-dtype auto"
        )


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def ring_pages(model: KVModel, page_size: int, spare: int = 0) -> int:
    """Pages of a request's window ring in every group (`spare`: rows kept past the window,
    KVCacheConfig.speculative_tokens)."""
    if not model.sliding_window:
        return 0
    return math.ceil((model.sliding_window + spare) / page_size)


def pages_past(model: KVModel, page_size: int, tokens: int, held: int, spare: int = 0) -> int:
    """Pages, over every group, of a request of `tokens` computed tokens but the full entry
    pages of its first `held` (which a reader's prefix cache holds): every window ring page,
    and the entry pages past those. What a decode worker pulls (KVPool.missing)."""
    ring = ring_pages(model, page_size, spare)
    return sum(
        ring
        + (-(-(tokens // g.ratio) // page_size) - (held // g.ratio) // page_size if g.ratio else 0)
        for g in model.kv_groups()
    )


def row_bytes(model: KVModel, esize: int, fp8: bool = False) -> tuple[int, int]:
    """Bytes of one cached row: (attention entry or window row, index key); model-dtype rows of
    esize-byte elements, or kernels.kv_quant's FP8 rows (584 for V4's, 656 for V3.2's; Di + 4)."""
    if fp8:
        return kv_token_bytes(model.head_dim), index_token_bytes(model.index_head_dim)
    return model.head_dim * esize, model.index_head_dim * esize


def group_row_bytes(model: KVModel, group: LayerGroup, esize: int, fp8: bool = False) -> int:
    """Bytes one slot of `group` costs in one layer: its KV row, and its index key if any."""
    kv, index = row_bytes(model, esize, fp8)
    return kv + (index if group.indexed else 0)


def bytes_per_token(model: KVModel, esize: int, fp8: bool = False) -> float:
    """KV bytes one more token of context costs a request (every layer, past its fixed window
    and ring): what a budget's spare bytes are divided by (plan_pages). The FP8 / bf16
    capacity ratio is bytes_per_token(model, 2) / bytes_per_token(model, 2, fp8=True)."""
    group_of = {i: g for g in model.kv_groups() for i in g.layers}
    return sum(  # (summed layer by layer, in layer order)
        group_row_bytes(model, g, esize, fp8) / g.ratio
        for _, g in sorted(group_of.items())
        if g.ratio
    )


def scratch_rows(model: KVModel, kv_cfg: KVCacheConfig) -> int:
    """Scratch rows behind the pages of every `kv[layer]`: one per row a step may compute, for a
    family whose rows cannot go to their slots before attention (V4: the window ring still holds
    rows the step's earlier queries read); none for one whose rows never move (V3.2)."""
    return kv_cfg.max_num_batched_tokens if model.needs_scratch_rows else 0


def scratch_pages(page_size: int, scratch_rows: int) -> int:
    """Pages an FP8 pool spends on its scratch rows and its trash row."""
    return -(-(scratch_rows + 1) // page_size)


def page_bytes(
    model: KVModel, page_size: int, esize: int, fp8: bool = False
) -> dict[str, list[int]]:
    """group -> bytes of one page in each of its layers' pools."""
    kv, index = row_bytes(model, esize, fp8)
    out: dict[str, list[int]] = {}
    for g in model.kv_groups():
        pools = out.setdefault(g.name, [])
        for _ in g.layers:
            pools.append(page_size * kv)
            if g.indexed:
                pools.append(page_size * index)
    return out


def cell_bytes(model: KVModel, page_size: int, esize: int, fp8: bool = False) -> int:
    """The largest size that divides every page of every pool (FP8 at P = 64: 256 bytes, where
    bf16 pages give 16 KiB)."""
    pages = page_bytes(model, page_size, esize, fp8)
    return math.gcd(*(b for pools in pages.values() for b in pools))


def staging_block_bytes(model: KVModel, page_size: int, esize: int, fp8: bool = False) -> int:
    """Bytes of one staging block: a page of the largest group, every layer of it (1.6 MB on
    V4-Flash in bf16, 0.9 MB in FP8). Depends only on the layout, so workers with different
    budgets agree on it."""
    return max(sum(pools) for pools in page_bytes(model, page_size, esize, fp8).values())


def ring_elems(model: KVModel, spare: int = 0) -> int:
    """Elements of every compressor ring of one request (kv and gate): what a slab row holds
    (`spare`: rows each ring keeps past what it needs, KVCacheConfig.speculative_tokens)."""
    return sum(2 * (r.rows + spare) * r.features for r in model.compressor_rings())


def scratch_bytes(model: KVModel, kv_cfg: KVCacheConfig, esize: int) -> int:
    """What the scratch rows and trash rows behind every layer's pages cost (a step's rows)."""
    P, B = kv_cfg.page_size, scratch_rows(model, kv_cfg)
    kv_row, index_row = row_bytes(model, esize, kv_cfg.fp8)
    total = 0
    for g in model.kv_groups():
        if kv_cfg.fp8:  # scratch + trash rows in whole pages, the index trash row in a page
            extra = scratch_pages(P, B) * P * kv_row + (P * index_row if g.indexed else 0)
        else:
            extra = (B + 2) * group_row_bytes(model, g, esize)
        total += extra * len(g.layers)
    return total


def sequence_bytes(model: KVModel, kv_cfg: KVCacheConfig, esize: int) -> int:
    """What a sequence holds whatever its length: its window ring's pages and one open entry page
    in every group, and its slab row (every compressor's rings)."""
    P = kv_cfg.page_size
    ring = ring_pages(model, P, kv_cfg.speculative_tokens)
    pages = sum(
        (ring + (1 if g.ratio else 0))
        * P
        * group_row_bytes(model, g, esize, kv_cfg.fp8)
        * len(g.layers)
        for g in model.kv_groups()
    )
    return pages + ring_elems(model, kv_cfg.speculative_tokens) * esize


def _fixed_and_per_token(
    model: KVModel, kv_cfg: KVCacheConfig, esize: int
) -> tuple[float, float, dict[str, tuple[int, int]]]:
    """(fixed bytes, bytes a token of capacity costs, group -> (base pages, ratio)) of a plan:
    scratch, each sequence's fixed state (`sequence_bytes`), each checkpoint's."""
    P, S = kv_cfg.page_size, kv_cfg.max_num_seqs
    ring = ring_pages(model, P, kv_cfg.speculative_tokens)
    per_token, pages = 0.0, {}
    for g in model.kv_groups():
        pages[g.name] = (
            S * (ring + (1 if g.ratio else 0)) + kv_cfg.checkpoint_rows * ring,
            g.ratio,
        )
        if g.ratio:
            per_token += group_row_bytes(model, g, esize, kv_cfg.fp8) * len(g.layers) / g.ratio
    each = checkpoint_bytes(model, P, esize, kv_cfg.fp8, kv_cfg.speculative_tokens)
    fixed = (
        scratch_bytes(model, kv_cfg, esize)
        + S * sequence_bytes(model, kv_cfg, esize)
        + kv_cfg.checkpoint_rows * each
    )
    return fixed, per_token, pages


def checkpoint_bytes(
    model: KVModel, page_size: int, esize: int, fp8: bool = False, spare: int = 0
) -> int:
    """What one checkpoint of the prefix cache holds of its own: a slab row (every compressor's
    rings) and the window ring's pages of every group (`spare`: ring_pages')."""
    ring = ring_pages(model, page_size, spare)
    pages = sum(
        page_size * group_row_bytes(model, g, esize, fp8) * len(g.layers) * ring
        for g in model.kv_groups()
    )
    return ring_elems(model, spare) * esize + pages


def default_checkpoint_rows(model: KVModel, kv_cfg: KVCacheConfig, esize: int) -> int:
    """Checkpoints for prefix caching: 1/CHECKPOINT_SHARE of the budget past the scratch rows,
    whatever max_num_seqs is (taken after the sequences' fixed state, at the default 256 they
    left one checkpoint of the demo model's 512 MiB, and the cache kept almost nothing); none
    for a family that keeps no per-position state (a checkpoint of it would hold nothing)."""
    each = checkpoint_bytes(model, kv_cfg.page_size, esize, kv_cfg.fp8, kv_cfg.speculative_tokens)
    if each == 0:
        return 0
    spare = kv_cfg.memory_bytes - scratch_bytes(model, kv_cfg, esize)
    return max(0, spare) // CHECKPOINT_SHARE // each


def fit_max_num_seqs(
    model: KVModel, kv_cfg: KVCacheConfig, esize: int, share: int = SEQUENCE_SHARE
) -> int:
    """The most sequences, up to max_num_seqs, whose fixed state (`sequence_bytes`) takes at
    most 1/share of what the scratch rows and the checkpoints leave of the budget, and less
    than all of it (share 1: an asked number, lowered only where it leaves nothing for
    context). The default share, SEQUENCE_SHARE, keeps the other half for context and staging:
    a sequence's fixed state is worth thousands of tokens of context on a small model, and
    at 256 sequences it took 97% of the demo model's default budget. Raises KVBudgetError,
    naming the flags, when not one fits."""
    each = checkpoint_bytes(model, kv_cfg.page_size, esize, kv_cfg.fp8, kv_cfg.speculative_tokens)
    scratch = scratch_bytes(model, kv_cfg, esize)
    left = kv_cfg.memory_bytes - scratch - kv_cfg.checkpoint_rows * each
    seq = sequence_bytes(model, kv_cfg, esize)
    fits = max(0, left - 1) // (share * seq)
    if fits < 1:
        raise KVBudgetError(
            f"KV cache budget of {kv_cfg.memory_bytes / 2**20:.1f} MiB leaves "
            f"{max(0, left) / 2**20:.1f} MiB past the scratch rows of "
            f"--max-num-batched-tokens {kv_cfg.max_num_batched_tokens} "
            f"({scratch / 2**20:.1f} MiB) and the prefix cache's checkpoints "
            f"({kv_cfg.checkpoint_rows * each / 2**20:.1f} MiB): too little for one sequence "
            f"({seq / 2**20:.2f} MiB of fixed state and its context); raise "
            "--kv-cache-memory-bytes or lower --max-num-batched-tokens or "
            "--prefix-cache-checkpoint-memory-bytes"
        )
    return min(kv_cfg.max_num_seqs, fits)


def plan_pages(
    model: KVModel, kv_cfg: KVCacheConfig, esize: int, block_bytes: int
) -> tuple[dict[str, int], int]:
    """Split the budget so every group can hold the same total number of tokens; returns
    (pages per group, staging blocks for staged requests).

    Fixed costs (scratch, slab rows, each sequence's ring pages plus one partial page per
    compressed group) come first. Of the rest, staged requests get `staging_bytes` (default
    1/STAGING_SHARE of it; the ring pulls land in is not part of the budget), and what is left
    buys token capacity C: a compressed group with rate r gets C / r / P more pages.
    """
    P, S = kv_cfg.page_size, kv_cfg.max_num_seqs
    fixed, per_token, pages = _fixed_and_per_token(model, kv_cfg, esize)
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
