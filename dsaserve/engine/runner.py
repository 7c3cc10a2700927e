"""Turns a scheduled batch into one model forward; decode-only batches replay CUDA graphs.

Graphs are captured at start-up for a list of batch sizes. A batch is padded to the next
captured size with rows that point at the pool's dummy page and slab row, so padding never
touches a real request's state. The index lists inside a graph are as wide as the context
length allows (page tables, HCA entries); the kernels read only each row's real length.
Block tables are gathered on the device from the pool's per-slab copy, so a replay only
refreshes positions, slab rows and token ids.

With async scheduling a decode row's input may be a token the previous step sampled that has
not reached the host (a `sampled_ref`): the runner swaps it for the id in `sampled` on the
device, in stream order after the sampling, and rank 0 broadcasts those ids to the other ranks
of its group, which sample nothing.

In a tensor-parallel group every rank has a runner over its own shard and pool. Rank 0's
scheduler decides each step; `call` sends the step (its RowSpans, and the page-table writes
since the last call) to the other ranks, then every rank runs the same method, whose
collectives meet inside the model. Graphs are captured on every rank in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.parallel.channel import Call, Channel
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.engine.prefix_cache.checkpoint import CopyPlan, capture_window_rows, run_copies
from dsaserve.engine.prefix_cache.host_tier import HostTier
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.request import Request
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.step import RowSpan, StepInputs, build_step_inputs

log = logging.getLogger(__name__)


class Model(Protocol):
    """What the runner asks of a family's model (engine.models: `build_model`)."""

    tp: TensorParallel  # its rank's place in the group
    cuda_graphs: bool  # whether a decode step may be captured (it reads nothing back to the host)

    def __call__(self, pool: KVPool, inputs: StepInputs, rows: torch.Tensor) -> torch.Tensor:
        """One step over `inputs`: fp32 logits of `rows` [len(rows), vocab]."""
        ...

    def counters(self) -> Mapping[str, tuple[str, int]]:
        """Cumulative counts of the model's own that a worker exports (name -> (help, value));
        read from another thread (the metrics scrape)."""
        ...


@dataclass(frozen=True)
class PromptRows:
    """`count` rows of a request's prompt, from position `start`, whose logits score the prompt
    tokens after them (SamplingParams.prompt_logprobs)."""

    request: Request
    start: int
    count: int

    def targets(self) -> list[int]:
        """The prompt tokens these rows predict."""
        return self.request.prompt_token_ids[self.start + 1 : self.start + 1 + self.count]


class DraftModel(Model, Protocol):
    """A model that drafts (speculative decoding; engine.speculative.draft_head)."""

    def run(
        self, pool: KVPool, inputs: StepInputs, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`__call__`'s logits and the streams [N, ...] its draft head reads, every row."""
        ...

    def draft(
        self, pool: KVPool, inputs: StepInputs, streams: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft head over `inputs` (a row's token: the one after its position) fed
        `streams`: (fp32 draft logits of `rows`, its own streams of every row)."""
        ...


class BlockDraftModel(Model, Protocol):
    """A model with a block drafter (DSpark; engine.speculative.dspark_drafter): its every step
    writes the drafter's context, and `draft_block` drafts."""

    def draft_block(
        self, pool: KVPool, inputs: StepInputs, anchors: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks of `inputs.block` rows (one span each) whose first tokens are anchors [B] ->
        (drafts [B, block] among the first `vocab` ids, confidences [B, block] fp32 or None)."""
        ...


@dataclass(frozen=True)
class LastStep:
    """The rows of the last `execute`, for the draft head's pass over the same rows."""

    requests: list[Request]  # one per span
    spans: list[RowSpan]
    num_decode: int


class ModelRunner:
    def __init__(
        self,
        model: Model,
        pool: KVPool,
        device: torch.device,
        max_context: int,
        channel: Channel | None = None,
        host: HostTier | None = None,
    ) -> None:
        """channel: rank 0's line to the other ranks of its tensor-parallel group (None on a
        single rank and on the other ranks, which receive the calls); host: this rank's host
        tier of the prefix cache (--kv-offloading-size)."""
        self.model, self.pool, self.device, self.max_context = (
            model,
            pool,
            torch.device(device),
            max_context,
        )
        self.tp, self.channel, self.host = model.tp, channel, host
        if channel is not None:
            pool.table_writes = []  # the other ranks replay them
        self.graphs: dict[int, _DecodeGraph] = {}
        self.graphs_enabled = True  # False: decode steps run eagerly (use_graphs)
        # [S] int64 on the device: the ids the last step sampled (rank 0 sets them); the next
        # step's sampled_refs read them
        self.sampled: torch.Tensor | None = None
        # speculative decoding (keep_streams): every rank's streams of its last step's rows,
        # which its draft head reads next ([N, ...] on the device)
        self.keep_streams = False
        self.streams: torch.Tensor | None = None
        self.last_step = LastStep([], [], 0)  # rank 0: what the last `execute` ran

    def capture_decode_graphs(self, batch_sizes: list[int]) -> None:
        mempool = torch.cuda.graph_pool_handle()
        for bs in sorted(batch_sizes, reverse=True):  # largest first: the rest reuse its memory
            self.graphs[bs] = _DecodeGraph(self, bs, mempool)
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def use_graphs(self, enabled: bool) -> None:
        """Every rank (through `call`): replay the captured decode graphs (the default), or run
        decode steps eagerly, so that a profiler sees every kernel (engine.profile)."""
        self.graphs_enabled = enabled

    def call(self, method: str, *args: object) -> Any:
        """Run `method(*args)` on every rank of the group (rank 0 calls; the others follow);
        rank 0's result."""
        if self.channel is not None:
            writes, self.pool.table_writes = self.pool.table_writes, []
            assert writes is not None  # (kept since the channel exists: __init__)
            self.channel.send(Call(method, args, writes))
        return getattr(self, method)(*args)

    def execute(
        self, batch: ScheduledBatch
    ) -> tuple[list[Request], list[int], torch.Tensor, list[PromptRows]]:
        """Run the step; returns the requests that sample now, the logit rows each has (1, or
        1 + its drafts for a request that verifies them), the logits [S + P, vocab] of those
        rows (S = sum of the counts, in their order) and then of the prompt rows whose logprobs
        were asked for (P), and the PromptRows that list those.

        Advances each scheduled request's `num_computed` by the rows it computed (the engine
        takes back what verification rejects).
        """
        work = (
            [(req, 1) for req in batch.decode]
            + [(req, 1 + len(req.draft_token_ids)) for req in batch.verify]
            + batch.prefill
        )
        depth = self.pool.cfg.token_lookback
        spans = [
            RowSpan(
                req.num_computed,
                n,
                req.slab_row,
                req.tokens(req.num_computed, n - len(drafts)) + drafts,
                batch.captures.get(req.request_id, ()),
                req.lookback(req.num_computed, depth),
                batch.anchors.get(req.request_id),
            )
            for req, n in work
            for drafts in [req.draft_token_ids if req in batch.verify else []]
        ]
        if batch.copies:  # prefix cache: requests resumed, checkpoints begun, tiers moved
            self.call("copy_pages", batch.copies)
        samplers, counts, rows, row = [], [], list[int](), 0
        prompt_rows: list[int] = []
        scored: list[PromptRows] = []
        for req, n in work:
            if req.params.prompt_logprobs is not None:
                # rows at positions j < P - 1 predict prompt token j + 1; each is scored once
                # (a preempted request computes its prompt again)
                first = max(req.num_computed, len(req.prompt_logprobs))
                last = min(req.num_computed + n, len(req.prompt_token_ids) - 1)
                if last > first:
                    scored.append(PromptRows(req, first, last - first))
                    prompt_rows += range(
                        row + first - req.num_computed, row + last - req.num_computed
                    )
            row += n
            if req.num_computed + n >= req.num_tokens:  # the chunk reaches the newest token
                samplers.append(req)
                sampled = req.num_computed + n - req.num_tokens + 1  # 1 + its drafts
                counts.append(sampled)
                rows.extend(range(row - sampled, row))
        logits = cast(
            torch.Tensor, self.call("forward", spans, len(batch.decode), rows + prompt_rows)
        )
        self.last_step = LastStep([req for req, _ in work], spans, len(batch.decode))
        for req, n in work:
            req.num_computed += n
        return samplers, counts, logits, scored

    def forward_all_rows(self, spans: list[RowSpan], num_decode: int) -> torch.Tensor:
        """Logits of every row of a step (scoring)."""
        return cast(torch.Tensor, self.call("forward", spans, num_decode, None))

    def forward(
        self, spans: list[RowSpan], num_decode: int, logit_rows: list[int] | None
    ) -> torch.Tensor:
        """Every rank: one step over `spans` (the first `num_decode` single-row decode spans);
        fp32 logits of `logit_rows` (None: every row). A decode-only step replays a graph."""
        graph = self._graph_for(spans, num_decode) if logit_rows is not None else None
        if graph is not None:  # (every row of a decode-only step samples)
            return graph.run(spans, self._sampled_ids(spans))
        inputs, rows = self._inputs(spans, num_decode, logit_rows)
        if self.keep_streams and logit_rows is not None:
            logits, self.streams = cast(DraftModel, self.model).run(self.pool, inputs, rows)
        else:
            logits = self.model(self.pool, inputs, rows)
        # (a draft pass over the same rows captures them again: the MTP layer's then written)
        self._capture(inputs)
        return logits

    def keep_draft_streams(self) -> None:
        """Every rank (through `call`): keep each step's streams for the draft head; decode
        steps then run eagerly (a graph keeps no streams)."""
        self.keep_streams = True

    def draft(self, spans: list[RowSpan], num_decode: int, logit_rows: list[int]) -> torch.Tensor:
        """Every rank: the draft head over the last step's rows (`spans`: the same rows, each
        row's token the one after it), fed that step's streams; fp32 draft logits of
        `logit_rows`. Keeps the head's streams for `draft_next`."""
        inputs, rows = self._inputs(spans, num_decode, logit_rows)
        assert self.streams is not None  # (forward kept them)
        model = cast(DraftModel, self.model)
        logits, self.streams = model.draft(self.pool, inputs, self.streams, rows)
        self._capture(inputs)
        return logits

    def draft_next(self, spans: list[RowSpan], stream_rows: list[int]) -> torch.Tensor:
        """Every rank: one more draft per span (one row each, its token the last draft), fed the
        head's streams of rows `stream_rows` of its last pass; fp32 logits [len(spans), vocab]."""
        inputs, rows = self._inputs(spans, len(spans), None)
        assert self.streams is not None  # (draft kept them)
        streams = self.streams[to_device(stream_rows, torch.int64, self.device)]
        logits, self.streams = cast(DraftModel, self.model).draft(self.pool, inputs, streams, rows)
        return logits

    def draft_block(
        self, spans: list[RowSpan], vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank: the block drafter over `spans` (one block each, its anchor then noise
        tokens; equal lengths); (drafts, confidences) [len(spans), block] on the device."""
        inputs, _ = self._inputs(spans, 0, [])
        inputs.block = spans[0].num_rows
        anchors = inputs.token_ids[inputs.req_row0]  # [B]
        return cast(BlockDraftModel, self.model).draft_block(self.pool, inputs, anchors, vocab)

    def _inputs(
        self, spans: list[RowSpan], num_decode: int, logit_rows: list[int] | None
    ) -> tuple[StepInputs, torch.Tensor]:
        """A step's inputs and its logit rows on the device (None: every row)."""
        with profiled("inputs"):
            inputs = build_step_inputs(self.pool, spans, num_decode, self.device)
            resolve_sampled(inputs.token_ids, self._sampled_ids(spans))
            rows = (
                torch.arange(inputs.num_rows, device=self.device)
                if logit_rows is None
                else to_device(logit_rows, torch.int64, self.device)
            )
        return inputs, rows

    def _capture(self, inputs: StepInputs) -> None:
        """The prefix cache's window rows of checkpoints inside the step's chunks."""
        captures = [(s.row0, s.start, s.captures) for s in inputs.segments if s.captures]
        if captures:
            capture_window_rows(self.pool, captures)

    def pad_step(self) -> None:
        """Every rank of an engine without work while another engine of its data-parallel
        group computes: one decode row on the dummy page and slab row (nothing real read or
        written), so that this engine's ranks meet the others' in the MoE layers' all-to-alls."""
        self.forward([RowSpan(0, 1, self.pool.dummy_slab, [0])], 1, [])

    def copy_pages(self, plan: CopyPlan) -> None:
        """Every rank: the prefix cache's copies before a step (restores, checkpoints, pages to
        and from the host tier)."""
        run_copies(self.pool, plan, self.host)

    def _sampled_ids(self, spans: list[RowSpan]) -> torch.Tensor | None:
        """Every rank: the ids the spans' sampled_refs stand for ([1 + largest row] int64 on
        the device; None when there are none), from rank 0's `sampled`."""
        rows = 1 + max((-1 - s.token_ids[-1] for s in spans), default=-1)  # refs are last
        if rows <= 0:
            return None
        if self.tp.rank == 0:
            assert self.sampled is not None  # (rank 0 sampled the step these refs name)
            ids = self.sampled[:rows]
        else:
            ids = torch.empty(rows, dtype=torch.int64, device=self.device)
        self.tp.broadcast(ids)
        return ids

    def share_pages(self, pages: dict[str, list[int]]) -> None:
        """Every rank: rank 0's contents of these pages (a KV transfer filled them there) into
        every rank's pool, as one broadcast of their bytes; pages: pool group -> page ids
        ("slab" -> slab rows), as KVPages holds them."""
        if self.tp.size == 1:
            return
        regions = [  # each region as bytes [pages, ...]
            (r.tensor.view(torch.uint8), to_device(pages[r.group], torch.int64, self.device))
            for r in self.pool.regions()
            if pages.get(r.group)
        ]
        sizes = [len(ids) * t[0].numel() for t, ids in regions]
        if self.tp.rank == 0:
            buf = torch.cat([t.index_select(0, ids).reshape(-1) for t, ids in regions])
        else:
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        self.tp.broadcast(buf)
        if self.tp.rank > 0:
            for (t, ids), part in zip(regions, buf.split(sizes), strict=True):
                t.index_copy_(0, ids, part.view(len(ids), *t.shape[1:]))

    def _graph_for(self, spans: list[RowSpan], num_decode: int) -> _DecodeGraph | None:
        # (a step whose streams the draft head reads runs eagerly)
        if num_decode < len(spans) or not self.graphs or not self.graphs_enabled:
            return None
        if self.keep_streams:
            return None
        fits = [bs for bs in self.graphs if bs >= num_decode]
        return self.graphs[min(fits)] if fits else None


class _DecodeGraph:
    """One captured decode step for `bs` rows, with static input buffers refreshed per replay."""

    def __init__(self, runner: ModelRunner, bs: int, mempool: Any) -> None:
        """mempool: torch.cuda.graph_pool_handle(), shared by every graph of the runner."""
        pool, dev = runner.pool, runner.device
        self.pool, self.bs = pool, bs
        arange = torch.arange(bs, device=dev)
        self.inputs = StepInputs(
            positions=torch.zeros(bs, dtype=torch.int64, device=dev),
            row_req=arange,
            req_past=torch.zeros_like(arange),
            req_row0=arange,
            slab=torch.full((bs,), pool.dummy_slab, dtype=torch.int64, device=dev),
            persist_rows=arange,
            token_ids=torch.zeros_like(arange),
            max_position=runner.max_context,
            num_decode=bs,
        )
        depth = pool.cfg.token_lookback
        if depth:
            self.inputs.lookback = torch.full((bs, depth), -1, dtype=torch.int64, device=dev)
        forward = lambda: runner.model(pool, self.inputs, arange)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = forward()

    def run(self, spans: list[RowSpan], sampled: torch.Tensor | None = None) -> torch.Tensor:
        """sampled: the ids the spans' sampled_refs stand for (ModelRunner._sampled_ids)."""
        n, inp, pool = len(spans), self.inputs, self.pool
        fields = to_device(
            [[s.start for s in spans], [s.slab for s in spans], [s.token_ids[0] for s in spans]],
            torch.int64,
            inp.positions.device,
        )  # [(position, slab, token), n]
        for buf, values, pad in zip(
            (inp.positions, inp.slab, inp.token_ids), fields, (0, pool.dummy_slab, 0), strict=True
        ):
            buf[:n].copy_(values)
            buf[n:].fill_(pad)
        resolve_sampled(inp.token_ids[:n], sampled)
        inp.req_past.copy_(inp.positions)
        if inp.lookback is not None:
            depth = inp.lookback.shape[1]
            rows = [[-1] * (depth - len(s.lookback)) + list(s.lookback) for s in spans]
            inp.lookback[:n].copy_(to_device(rows, torch.int64, inp.lookback.device))
            inp.lookback[n:].fill_(-1)
        self.graph.replay()
        return self.logits[:n]


def resolve_sampled(token_ids: torch.Tensor, sampled: torch.Tensor | None) -> None:
    """token_ids [n] int64 on the device, in place: each sampled_ref(i) -> sampled[i]."""
    if sampled is not None:
        row = (-1 - token_ids).clamp(min=0)  # (real ids pick row 0, then keep their own)
        token_ids.copy_(torch.where(token_ids < 0, sampled[row], token_ids))
