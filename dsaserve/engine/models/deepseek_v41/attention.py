"""DeepSeek-V4.1 attention: a window of the layer's own rows plus compressed entries (CSA2).

From DeepSeek's inference/model.py `Attention` (with `_window_kv`, `_compress_kv`,
`_compress_topk_idxs`):
- q = wq_b(q_norm(wq_a(x))) per head, RoPE on the last rope dims (no per-head norm, unlike V4);
- kv = RoPE(kv_norm(wkv(x))): one 512-d row per token, both key and value, in the window of the
  last `sliding_window` positions (the query's own included);
- a compressed layer (ratio 1 or 2) also attends to entries of its KV source (itself, or the
  latest source below it): the `index_topk` its index source picks (engine.models.deepseek_v41
  .indexer); a KV source computes them (engine.models.deepseek_v41.compressor) and its indexer's
  keys from them, then stores each entry rotated at its first position;
- softmax over window and entries with the per-head sink in the denominator, the output's rope
  dims rotated back, then the grouped low-rank projection wo_a (per group) and wo_b. The rotary
  table: YaRN at `compress_rope_theta` for compressed layers, plain `rope_theta` for sliding ones.

Pools (engine.models.deepseek_v41.config.kv_groups): a layer's window rows live in its own
`kv[layer]`, a source's entries in its own `kv[layer]` after its ring pages, so a source attends
with one index list, and a reading layer with two (its window, the source's entries) whose
softmaxes are merged by their log-sum-exps.

A layer computes its KV on the rows it takes as input and its output on a subset of them
(engine.models.deepseek_v41.rows: bounded decoder replay); a row's scratch slot stays its step
row's, so every window is read where any layer writes it.

Tensor parallel, as V4's: query heads and output groups per rank (wq_b, attn_sink, wo_a), wo_b
row parallel; wq_a, wkv, the norms, the compressor and the indexer replicated, so every rank
writes the same KV and picks the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import column_parallel
from dsaserve.engine.models.deepseek_v4.config import Quantization
from dsaserve.engine.models.deepseek_v41.compressor import Compressor
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.models.deepseek_v41.indexer import Indexer
from dsaserve.engine.models.deepseek_v41.rows import Rows
from dsaserve.engine.parallel.group import SINGLE, TensorParallel, shard
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepState


@dataclass
class StepShared:
    """What a step's layers hand down the stack (the release's SharedAttentionRuntime): each index
    source's picks [N, topk] by step row, and the candidate source's blocks."""

    picks: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[str, torch.Tensor] = field(default_factory=dict)


class Attention(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        fp8, block = quant is not None, quant.block if quant else 0
        ratio = cfg.compress_ratio(layer)
        self.layer, self.ratio, self.topk = layer, ratio, cfg.index_topk
        self.heads, self.groups = tp.local(cfg.num_heads), tp.local(cfg.o_groups)
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.rope_kind = "compress" if ratio else "main"
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank, fp8, block=block)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = column_parallel(
            linear(cfg.q_lora_rank, self.heads * cfg.head_dim, fp8, block=block)
        )
        self.wkv = linear(cfg.hidden_size, cfg.head_dim, fp8, block=block)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        group_in = cfg.num_heads * cfg.head_dim // cfg.o_groups
        # dense even in FP8 checkpoints: the release's convert.py dequantizes it (bf16 einsum)
        self.wo_a = shard(
            torch.nn.Parameter(torch.zeros(self.groups * cfg.o_lora_rank, group_in)), 0
        )
        self.wo_b = linear(
            self.groups * cfg.o_lora_rank, cfg.hidden_size, fp8, row_parallel=tp, block=block
        )
        self.attn_sink = shard(torch.nn.Parameter(torch.zeros(self.heads, dtype=torch.float32)), 0)
        self.source = cfg.kv_source_of(layer) if ratio else -1  # whose entries it reads
        self.index_source = cfg.index_source_of(layer) if ratio else -1  # whose picks
        self.compressor = None
        if layer in cfg.kv_sources:
            self.compressor = Compressor(cfg.hidden_size, cfg.head_dim, ratio, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, layer, quant) if layer in cfg.index_sources else None

    def forward(
        self,
        x: torch.Tensor,
        step: StepState,
        shared: StepShared,
        rows_in: Rows | None,
        rows_out: Rows | None,
    ) -> torch.Tensor:
        """x [M_in, hidden] of the step's rows `rows_in` (None: all) -> [M_out, hidden] of
        `rows_out` (a subset of them); reads and writes this layer's KV state through `step`."""
        with profiled("attention"):
            return self._forward(x, step, shared, rows_in, rows_out)

    def _forward(
        self,
        x: torch.Tensor,
        step: StepState,
        shared: StepShared,
        rows_in: Rows | None,
        rows_out: Rows | None,
    ) -> torch.Tensor:
        pool, inp = step.pool, step.inp
        group = pool.group_of_layer[self.layer]
        slots = pool.groups[group].kv[self.layer]  # [S, D]: ring pages (and entries), scratch
        cos, sin = step.rope(self.rope_kind)
        take_in = (lambda t: t) if rows_in is None else (lambda t: t[rows_in.index])
        kv = kernels.apply_rope(self.kv_norm(self.wkv(x)), take_in(cos), take_in(sin))
        pool.write(slots, take_in(step.scratch_slots(group)), kv)
        decode = inp.num_decode  # (the first rows of every subset: a ring slot outside the
        # step's windows, so written before attention)
        pool.write(slots, step.persist_slots(group)[:decode], kv[:decode])
        if self.compressor is not None:
            with profiled("compressor"):
                self._compress(x, step, group)
        if rows_out is not None and not len(rows_out.index):  # (KV only: no row reads it here)
            self._persist(kv, step, group, rows_in)
            return x.new_empty(0, x.shape[1])
        local = _local(rows_in, rows_out)
        x_out = x if local is None else x[local]
        out_index = None if rows_out is None else rows_out.index
        take_out = (lambda t: t) if out_index is None else (lambda t: t[out_index])
        q_residual = self.q_norm(self.wq_a(x_out))
        q = self.wq_b(q_residual).unflatten(-1, (self.heads, self.head_dim))
        q = kernels.apply_rope(q, take_out(cos), take_out(sin))
        positions, row_req = take_out(inp.positions), take_out(inp.row_req)
        window, _ = kernels.sparse_indices(
            positions,
            row_req,
            inp.req_past,
            inp.req_row0,
            step.table(group),
            ring_pages=pool.ring_pages,
            page_size=pool.page_size,
            scratch_base=pool.entry_slot_base(group),
            window=self.window,
        )  # [M_out, W] int32 slots
        scale = self.head_dim**-0.5
        if not self.ratio:
            with profiled("sparse_mla"):
                out, _ = kernels.sparse_mla_decode(
                    q, slots, window, scale, d_v=self.head_dim, sinks=self.attn_sink
                )
        else:
            picks = self._picks(x_out, q_residual, step, shared, out_index)
            source_group = pool.group_of_layer[self.source]
            entry_tables = step.table(source_group)[row_req, pool.ring_pages :]
            entries = kernels.positions_to_slots(picks, entry_tables, pool.page_size)
            with profiled("sparse_mla"):
                if self.source == self.layer:  # its window and entries share one slot space
                    indices = torch.cat((window, entries), dim=1)
                    out, _ = kernels.sparse_mla_decode(
                        q, slots, indices, scale, d_v=self.head_dim, sinks=self.attn_sink
                    )
                else:
                    source = pool.groups[source_group].kv[self.source]
                    out = _two_sources(q, (slots, window), (source, entries), scale, self.attn_sink)
        self._persist(kv, step, group, rows_in)
        out = kernels.attention_post(out, take_out(cos), take_out(sin))  # RoPE undone (V had it)
        n = out.shape[0]
        grouped = out.reshape(n, self.groups, -1).transpose(0, 1)  # [G, M, H*D/G]
        w = self.wo_a.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)  # [G, H*D/G, R]
        return self.wo_b(torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1))

    def _persist(self, kv: torch.Tensor, step: StepState, group: str, rows_in: Rows | None) -> None:
        """Prefill rows' KV into the window ring, after attention (a chunk's earlier queries
        still read the ring rows these replace)."""
        pool, inp = step.pool, step.inp
        if not inp.segments:
            return
        slots = pool.groups[group].kv[self.layer]
        if rows_in is None:
            decode = inp.num_decode
            pool.write(slots, step.persist_slots(group)[decode:], kv[inp.persist_rows[decode:]])
        else:
            rows = rows_in.persist_global
            ring = step.ring_slots(group, inp.positions[rows], inp.row_req[rows])
            pool.write(slots, ring, kv[rows_in.persist_local])

    def _compress(self, x: torch.Tensor, step: StepState, group: str) -> None:
        """The source's entries completed by this step (and the indexer's keys from them),
        written at their entry slots (a decode row that completes none: the trash rows)."""
        pool = step.pool
        ring = pool.comp_ring.get(self.layer)
        assert self.compressor is not None
        latents, reqs, entries = self.compressor(x, step, ring)
        if not len(latents):
            return
        first = (entries.clamp(min=0) * self.ratio).to(step.inp.positions.dtype)
        cos, sin = step.rope_tables["compress"](first, pool.dtype)
        slots = step.entry_slots(group, reqs, entries.clamp(min=0))
        done = entries >= 0
        if self.indexer is not None and self.indexer.owns_keys:
            keys = self.indexer.keys(latents, cos, sin)
            trash = pool.index_trash_slot(group)
            pool.write(
                pool.groups[group].index_k[self.layer], torch.where(done, slots, trash), keys
            )
        rotated = kernels.apply_rope(latents, cos, sin)
        kv = pool.groups[group].kv[self.layer]
        pool.write(kv, torch.where(done, slots, pool.trash_slot(group)), rotated)

    def _picks(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        step: StepState,
        shared: StepShared,
        out_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """[M_out, topk] entry positions (-1: none): the indexer's, or its index source's."""
        if self.indexer is None:
            picks = shared.picks[self.index_source]
            return picks if out_index is None else picks[out_index]
        pool = step.pool
        owner_group = pool.group_of_layer[self.source]
        keys = pool.groups[owner_group].index_k[self.source]
        with profiled("indexer"):
            picks = self.indexer(
                x, q_residual, step, out_index, keys, owner_group, shared.candidates
            )
        if out_index is None:
            shared.picks[self.layer] = picks
        else:
            full = torch.full(
                (step.inp.num_rows, picks.shape[1]), -1, dtype=picks.dtype, device=picks.device
            )
            full[out_index] = picks
            shared.picks[self.layer] = full
        return picks


def _local(rows_in: Rows | None, rows_out: Rows | None) -> torch.Tensor | None:
    """Where the rows of `rows_out` sit in `rows_in` (None: the same rows)."""
    if rows_out is None:
        return None
    if rows_in is None:
        return rows_out.index
    return torch.searchsorted(rows_in.index, rows_out.index)


def _two_sources(
    q: torch.Tensor,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """One softmax over the slots of two pools (kv, indices [M, K] each), the sinks in its
    denominator: each pool's attention normalized by its own sum, weighted back by the sums."""
    out_a, lse_a = kernels.sparse_mla_decode(q, a[0], a[1], scale, d_v=q.shape[-1])
    out_b, lse_b = kernels.sparse_mla_decode(q, b[0], b[1], scale, d_v=q.shape[-1])
    top = torch.maximum(torch.maximum(lse_a, lse_b), sinks[None, :])  # [M, H] fp32
    w_a, w_b = (lse_a - top).exp(), (lse_b - top).exp()  # (-inf: a pool with no valid slot)
    total = w_a + w_b + (sinks[None, :] - top).exp()
    out = out_a.float() * (w_a / total)[..., None] + out_b.float() * (w_b / total)[..., None]
    return out.to(q.dtype)
