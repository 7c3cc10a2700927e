"""Lightning indexer of CSA layers: picks each query's top-k compressed entries.

score(t, w) = sum_h weight[t, h] * relu(q[t, h] . k[w]) * index_head_dim^-0.5 over the entries
w visible to t; the keys come from the indexer's own overlapping compressor. Scoring and
top-k run in `kernels.indexer_topk`, whose work follows each request's real entry count.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.indexer_topk import step_topk
from dsaserve.engine.models.deepseek_v4.compressor import Compressor
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.step import StepState


class Indexer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: Quantization | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rate, self.layer = cfg.compress_rate(layer), layer
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.head_dim, quant is not None)
        self.weights_proj = torch.nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(
            cfg.hidden_size, self.head_dim, self.rate, overlap=True, eps=cfg.rms_norm_eps
        )

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, step: StepState) -> torch.Tensor:
        """x [N, hidden], q_residual [N, q_lora] -> [N, topk] int32 positions of the picked
        compressed entries (-1 = none); kernels.sparse_indices maps them to slots."""
        pool, inp = step.pool, step.inp
        keys = pool.groups["csa"].index_k[self.layer]  # [slots, Di], or FP8 pages
        self.compressor(x, step, pool.index_ring[self.layer], keys, "csa", pool.index_trash_slot())
        n = x.shape[0]
        cos, sin = step.rope("compress")
        q, weights, lengths = kernels.indexer_query(
            self.wq_b(q_residual).view(n, self.heads, self.head_dim),
            self.weights_proj(x),
            cos,
            sin,
            inp.positions,
            self.rate,
        )  # [N, Hi, Di] with RoPE, [N, Hi] fp32, [N] int32 visible entries
        # [pages, P, Di], or FP8 pages [pages, P * (Di + 4)] (indexer_topk dequantizes them)
        k_cache = pool.pages_of(keys, pool.groups["csa"].num_pages)
        entry_tables = step.table("csa")[:, pool.ring_pages :]  # [B, pages]
        scale = self.head_dim**-0.5
        return step_topk(step, entry_tables, q, weights, k_cache, lengths, self.topk, scale)
