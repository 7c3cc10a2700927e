"""DeepSeek-V4 attention: one shared K=V head over a sliding window plus compressed entries.

q: low-rank (wq_a -> norm -> wq_b), per-head unweighted RMS norm, RoPE on the trailing dims.
kv: one 512-d row per token (wkv -> norm -> RoPE), used as both key and value. Each query
attends to its window (the last `sliding_window` rows) and, in CSA layers, to the indexer's
top-k compressed entries, in HCA layers to every visible compressed entry. Per-head sinks
join the softmax denominator. The output's rope dims are rotated back (V carried RoPE), then
a grouped low-rank projection (wo_a per head group, then wo_b) maps it to the hidden size.

Tensor parallel, as the release splits it: each rank holds a contiguous share of the query
heads (wq_b's rows, attn_sink) and of the output groups (wo_a's rows), and wo_b is row parallel
(one fp32 all-reduce per layer). wq_a, wkv, the norms, the compressor and the whole indexer are
replicated, so every rank writes the same KV (the one KV head serves all query heads) and picks
the same top-k: the release splits the indexer's heads and all-reduces its [rows, entries]
scores before the top-k, but the fused score-and-select kernel here never materialises those
scores, and every rank must read all the keys anyway, so a split would save a share of a
small GEMM for a collective that grows with the context.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import column_parallel
from dsaserve.engine.models.deepseek_v4.compressor import Compressor
from dsaserve.engine.models.deepseek_v4.config import CSA, SLIDING, ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.indexer import Indexer
from dsaserve.engine.parallel.group import SINGLE, TensorParallel, shard
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepState


class Attention(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """quant: the checkpoint's formats to keep in memory (None: dense weights); tp: the
        group whose ranks share the heads."""
        super().__init__()
        kind = cfg.attention_kind(layer)
        fp8 = quant is not None
        self.layer, self.heads, self.head_dim, self.groups = (
            layer,
            tp.local(cfg.num_heads),  # this rank's query heads
            cfg.head_dim,
            tp.local(cfg.o_groups),  # and the output groups they form
        )
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.rope_kind = "main" if kind == SLIDING else "compress"
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank, fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = column_parallel(linear(cfg.q_lora_rank, self.heads * cfg.head_dim, fp8))
        self.wkv = linear(cfg.hidden_size, cfg.head_dim, fp8)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        group_in = cfg.num_heads * cfg.head_dim // cfg.o_groups
        # Block-diagonal, dense even in FP8 checkpoints: the release's convert.py dequantizes it
        # and runs the grouped projection as a bf16 einsum.
        self.wo_a = shard(
            torch.nn.Parameter(torch.zeros(self.groups * cfg.o_lora_rank, group_in)), 0
        )
        self.wo_b = linear(self.groups * cfg.o_lora_rank, cfg.hidden_size, fp8, row_parallel=tp)
        self.attn_sink = shard(torch.nn.Parameter(torch.zeros(self.heads, dtype=torch.float32)), 0)
        self.compressor = None
        self.indexer = None
        if kind != SLIDING:
            self.compressor = Compressor(
                cfg.hidden_size,
                cfg.head_dim,
                cfg.compress_rate(layer),
                overlap=kind == CSA,
                eps=cfg.rms_norm_eps,
            )
        if kind == CSA:
            self.indexer = Indexer(cfg, layer, quant)

    def forward(self, x: torch.Tensor, step: StepState) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; reads and writes this layer's KV state through `step`."""
        with profiled("attention"):
            return self._forward(x, step)

    def _forward(self, x: torch.Tensor, step: StepState) -> torch.Tensor:
        n, pool, inp = x.shape[0], step.pool, step.inp
        group = pool.group_of_layer[self.layer]
        cos, sin = step.rope(self.rope_kind)
        slots = pool.groups[group].kv[self.layer]  # [S, D], or FP8 pages (engine.kv.pool)
        q_residual = self.q_norm(self.wq_a(x))  # [N, q_lora]
        # Per-head norm + RoPE of q; norm + RoPE of kv, written to the step's scratch rows and,
        # for decode rows, to the ring (a decode row's ring slot lies outside every window of
        # the step, so it can be written before attention). FP8 pools: quantized on write, so
        # the step's own rows are read back as the FP8 rows later steps will read.
        q, kv = kernels.attention_pre(
            self.wq_b(q_residual).view(n, self.heads, self.head_dim),
            self.wkv(x),
            self.kv_norm.weight,
            self.eps,
            cos,
            sin,
            slots,
            step.scratch_slots(group),
            step.persist_slots(group)[: inp.num_decode],
        )  # [N, H, D], [N, D]
        picked, hca = None, {}
        if self.compressor is not None:
            with profiled("compressor"):
                self.compressor(
                    x, step, pool.comp_ring[self.layer], slots, group, pool.trash_slot(group)
                )
            if self.indexer is not None:
                with profiled("indexer"):
                    picked = self.indexer(x, q_residual, step)  # [N, topk] entry positions
            else:
                ratio = pool.groups[group].ratio
                hca = {"hca_ratio": ratio, "hca_width": hca_width(inp.max_position, ratio)}
        # A DSpark block's rows all see what its last row would see with a window widened by
        # the block: the W context rows before the block, then every row of the block.
        keys_of, window = inp.positions, self.window
        if inp.block:
            keys_of = inp.req_past[inp.row_req] + inp.block - 1
            window += inp.block
        indices, lengths = kernels.sparse_indices(
            keys_of,
            inp.row_req,
            inp.req_past,
            inp.req_row0,
            step.table(group),
            ring_pages=pool.ring_pages,
            page_size=pool.page_size,
            scratch_base=pool.entry_slot_base(group),
            window=window,
            picked=picked,
            **hca,
        )  # [N, W (+ topk | hca_width)] int32 slots, -1 = none
        with profiled("sparse_mla"):
            out, _ = kernels.sparse_mla_decode(
                q,
                slots,
                indices,
                self.head_dim**-0.5,
                d_v=self.head_dim,
                sinks=self.attn_sink,
                lengths=lengths,
            )  # [N, H, D]
        if inp.segments and not inp.block:
            # Prefill rows persist after attention: earlier queries of a long chunk still read
            # the old ring rows.
            decode = inp.num_decode
            rows = inp.persist_rows[decode:]
            pool.write(slots, step.persist_slots(group)[decode:], kv[rows])
        out = kernels.attention_post(out, cos, sin)  # RoPE's rotation undone (V carried it)
        grouped = out.reshape(n, self.groups, -1).transpose(0, 1)  # [G, N, H*D/G]
        w = self.wo_a.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)  # [G, H*D/G, R]
        return self.wo_b(torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1))


def write_context(attn: Attention, main_x: torch.Tensor, step: StepState) -> None:
    """A DSpark draft layer's context: the target's projected hidden states main_x [N, hidden]
    of the step's rows become this layer's KV rows at their positions, RoPE(kv_norm(wkv(main_x)))
    as its own rows would be, written to the step's scratch rows (where a prefix-cache capture
    reads a step's window rows) and to the window ring."""
    pool, inp = step.pool, step.inp
    group = pool.group_of_layer[attn.layer]
    cos, sin = step.rope(attn.rope_kind)
    kv = kernels.apply_rope(
        kernels.rms_norm(attn.wkv(main_x), attn.kv_norm.weight, attn.eps), cos, sin
    )
    slots = pool.groups[group].kv[attn.layer]
    pool.write(slots, step.scratch_slots(group), kv)
    pool.write(slots, step.persist_slots(group), kv[inp.persist_rows])


def hca_width(max_position: int, ratio: int) -> int:
    """Entry columns of an HCA layer's index lists: >= every row's visible entries."""
    return (max_position + 1) // ratio
