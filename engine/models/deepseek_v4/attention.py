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

from engine.layers.fp8_linear import linear
from engine.layers.norm import RMSNorm, unweighted_rms_norm
from engine.layers.parallel import column_parallel
from engine.models.deepseek_v4.compressor import Compressor
from engine.models.deepseek_v4.config import CSA, SLIDING, ModelConfig, Quantization
from engine.models.deepseek_v4.indexer import Indexer
from engine.parallel.group import SINGLE, TensorParallel, shard
from engine.profiling import profiled
from engine.step import StepState
from kernels import apply_rope, sparse_mla_decode


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
        n, pool = x.shape[0], step.pool
        group = pool.group_of_layer[self.layer]
        cos, sin = step.rope(self.rope_kind)
        q_residual = self.q_norm(self.wq_a(x))  # [N, q_lora]
        q = unweighted_rms_norm(self.wq_b(q_residual).view(n, self.heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)  # [N, H, D]
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [N, D]

        slots = pool.groups[group].kv[self.layer]  # [S, D]
        slots.index_copy_(0, step.scratch_slots(group), kv)
        indices, lengths = step.window_indices(group), None  # [N, W]
        if self.compressor is not None:
            with profiled("compressor"):
                self.compressor(
                    x, step, pool.comp_ring[self.layer], slots, group, pool.trash_slot(group)
                )
            if self.indexer is not None:
                with profiled("indexer"):
                    picked = self.indexer(x, q_residual, step)
                indices = torch.cat((indices, picked), dim=1)
            else:
                entries, counts = step.hca_indices()
                indices, lengths = (
                    torch.cat((indices, entries), dim=1),
                    (counts + self.window).to(torch.int32),
                )
        with profiled("sparse_mla"):
            out, _ = sparse_mla_decode(
                q,
                slots,
                indices.to(torch.int32),
                self.head_dim**-0.5,
                d_v=self.head_dim,
                sinks=self.attn_sink,
                lengths=lengths,
            )  # [N, H, D]
        # Persist after attention: earlier queries of a long chunk still read the old ring rows.
        slots.index_copy_(0, step.persist_slots(group), kv[step.inp.persist_rows])

        out = apply_rope(out, cos, sin, inverse=True)
        grouped = out.reshape(n, self.groups, -1).transpose(0, 1)  # [G, N, H*D/G]
        w = self.wo_a.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)  # [G, H*D/G, R]
        return self.wo_b(torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1))
