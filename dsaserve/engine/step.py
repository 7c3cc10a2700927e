"""The model's view of the KV state for one forward step: where rows go, what they read.

A step computes N rows: first one row per decoding request, then the rows of each
prefill chunk. Everything the layers need is derived from a few small tensors
(`StepInputs`), so a decode step's derivations can be captured in a CUDA graph and
replayed after refreshing those tensors in place. Derived index lists are cached per
pool group and shared by all layers of the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.prefix_cache.checkpoint import Capture

T = TypeVar("T")


def sampled_ref(row: int) -> int:
    """The token id that stands for "the id the previous step sampled in row `row`" in a step
    scheduled while that step still runs (async scheduling): negative, so never a real id; the
    runner swaps it for the sampled id on the device (ModelRunner.sampled)."""
    return -1 - row


@dataclass(frozen=True)
class RowSpan:
    """The rows one request computes in a step: tokens [start, start + num_rows) of it (the
    last one may be a `sampled_ref`)."""

    start: int  # position of the first row = tokens of the request already computed
    num_rows: int
    slab: int  # the request's slab row
    token_ids: list[int]  # the tokens at those positions
    captures: tuple[Capture, ...] = ()  # checkpoints of the prefix cache inside this chunk
    # the KVModel.token_lookback tokens before `start` (fewer at the sequence's start), oldest
    # first: what the family's rows read of the request's earlier tokens (V4.1's n-grams)
    lookback: tuple[int, ...] = ()
    # positions (> start, up to KVModel.prefill_halo past the chunk) after which the request's
    # state must be exact: where it samples, checkpoints, its prompt's end; a family with a
    # halo computes only the rows they need. None: every row (a decode row, prompt logprobs)
    anchors: tuple[int, ...] | None = None

    def __reduce__(self) -> tuple:
        # Pickled as its fields (half the time of a dataclass's default): rank 0 of a
        # tensor-parallel group sends every step's spans to the other ranks.
        return RowSpan, (
            self.start,
            self.num_rows,
            self.slab,
            self.token_ids,
            self.captures,
            self.lookback,
            self.anchors,
        )


@dataclass(frozen=True)
class Segment:
    """Host-side description of one prefill chunk (decode rows need none)."""

    row0: int  # first row of the chunk in the step
    start: int  # position of its first row = tokens of the request already computed
    num_rows: int
    slab: int
    req: int  # index of the request in the step
    captures: tuple[Capture, ...] = ()  # where its compressors also keep their rings (checkpoint)
    anchors: tuple[int, ...] | None = None  # RowSpan.anchors


@dataclass
class StepInputs:
    positions: torch.Tensor  # [N] int64
    row_req: torch.Tensor  # [N] int64, request index of each row
    req_past: torch.Tensor  # [B] int64, tokens computed before this step
    req_row0: torch.Tensor  # [B] int64, first row of each request
    slab: torch.Tensor  # [B] int64, slab row of each request (its page tables' row)
    persist_rows: torch.Tensor  # [M] int64, rows written to the window ring after attention
    token_ids: torch.Tensor  # [N] int64 (hash-routed MoE layers route by token id)
    # >= every row's position, known without reading them back: the data's in an eager step,
    # the context limit in a decode graph (so shapes sized from it stay valid on replay)
    max_position: int
    num_decode: int  # rows [0, num_decode) are single-token decode rows
    segments: list[Segment] = field(default_factory=list)
    # [B, KVModel.token_lookback] int64: each request's tokens before its first row of the step,
    # the newest last, -1 before its sequence's start (None: the family reads none)
    lookback: torch.Tensor | None = None
    # DSpark draft blocks (engine.layers.dspark): every span is one block of `block` rows, each
    # of which attends to the sliding window before its block and to its whole block, and
    # persists nowhere; 0: a step of the target (or an MTP pass), causal
    block: int = 0

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]


def build_step_inputs(
    pool: KVPool,
    spans: list[RowSpan],
    num_decode: int,
    device: torch.device,
) -> StepInputs:
    """spans: one per request, the `num_decode` single-row decode spans first."""
    positions: list[int] = []
    row_req: list[int] = []
    token_ids: list[int] = []
    persist: list[int] = []
    segments: list[Segment] = []
    req_past: list[int] = []
    req_row0: list[int] = []
    slabs: list[int] = []
    depth = pool.cfg.token_lookback
    lookback: list[list[int]] = []
    row = 0
    for b, span in enumerate(spans):
        start, n, slab, toks = span.start, span.num_rows, span.slab, span.token_ids
        assert len(toks) == n and (b >= num_decode or n == 1)
        positions.extend(range(start, start + n))
        row_req.extend([b] * n)
        token_ids.extend(toks)
        # Only the newest ring_len rows survive in the ring; writing only those keeps the
        # scatter free of duplicate targets.
        persist.extend(range(row + max(0, n - pool.ring_len), row + n))
        req_past.append(start)
        req_row0.append(row)
        slabs.append(slab)
        if b >= num_decode:
            segments.append(Segment(row, start, n, slab, b, span.captures, span.anchors))
        if depth:
            lookback.append([-1] * (depth - len(span.lookback)) + list(span.lookback))
        row += n

    def t(x: list[int]) -> torch.Tensor:
        return to_device(x, torch.int64, device)

    return StepInputs(
        positions=t(positions),
        row_req=t(row_req),
        req_past=t(req_past),
        req_row0=t(req_row0),
        slab=t(slabs),
        persist_rows=t(persist),
        token_ids=t(token_ids),
        max_position=max(positions, default=0),
        num_decode=num_decode,
        segments=segments,
        lookback=to_device(lookback, torch.int64, device) if depth else None,
    )


class StepState:
    """StepInputs plus the pool, with per-group derived index lists computed on demand."""

    def __init__(
        self, pool: KVPool, inputs: StepInputs, rope_tables: dict[str, RotaryTable]
    ) -> None:
        self.pool, self.inp, self.rope_tables = pool, inputs, rope_tables
        self._cache: dict[tuple, Any] = {}  # tensors, or (cos, sin) pairs

    def rope(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, rope_dim // 2] of every row for the "main" or "compress" table."""
        return self._cached(
            ("rope", kind), lambda: self.rope_tables[kind](self.inp.positions, self.pool.dtype)
        )

    def _cached(self, key: tuple, make: Callable[[], T]) -> T:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ---------------------------------------------------------------- slots

    def table(self, group: str) -> torch.Tensor:
        """[B, max_pages] int32 page tables of this step's requests (from the pool's device
        copy)."""
        return self._cached(
            ("table", group), lambda: self.pool.page_tables[group].index_select(0, self.inp.slab)
        )

    def row_tables(self, tables: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
        """The step's rows in runs that share page-table rows, each run with its tables
        [rows, pages]: the decode rows (requests 0..D-1 in order) with their own rows of
        `tables` [B, pages], each prefill chunk with its request's row broadcast (no copy)."""
        inp = self.inp
        runs = [(slice(0, inp.num_decode), tables[: inp.num_decode])] if inp.num_decode else []
        return runs + [
            (slice(s.row0, s.row0 + s.num_rows), tables[s.req].expand(s.num_rows, -1))
            for s in inp.segments
        ]

    def entry_slots(self, group: str, req: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """Slot ids of compressed entries `entry` (any shape) of requests `req` (broadcastable)."""
        P, pool = self.pool.page_size, self.pool
        page = self.table(group)[
            req, pool.ring_pages + torch.div(entry, P, rounding_mode="floor")
        ].long()
        return page * P + entry.remainder(P)

    def scratch_slots(self, group: str) -> torch.Tensor:
        """[N] the scratch row of every row of this step in the slot space of `group`."""
        return self._cached(
            ("scratch", group),
            lambda: (
                self.pool.entry_slot_base(group)
                + torch.arange(self.inp.num_rows, device=self.inp.positions.device)
            ),
        )

    def ring_slots(self, group: str, positions: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        P, ring = self.pool.page_size, positions.remainder(self.pool.ring_len)
        return self.table(group)[
            req, torch.div(ring, P, rounding_mode="floor")
        ].long() * P + ring.remainder(P)

    def persist_slots(self, group: str) -> torch.Tensor:
        """[M] ring slots for the rows in `persist_rows`."""
        rows = self.inp.persist_rows
        return self._cached(
            ("persist", group),
            lambda: self.ring_slots(group, self.inp.positions[rows], self.inp.row_req[rows]),
        )
