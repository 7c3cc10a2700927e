"""DeepSeek-V3.2 attention: MLA in its absorbed form over the indexer's top-k tokens.

Per token one row is cached: [kv_norm(latent) (kv_lora_rank) | RoPE'd key (qk_rope_head_dim)],
576 values in the release, from wkv_a(x). Queries come low-rank (wq_a -> q_norm -> wq_b), each
head [nope | rope]; RoPE is the interleaved one (the release's, HF's apply_rotary_pos_emb_
interleave computes the same dot products). wkv_b maps the latent to every head's key nope part
(W_UK) and value (W_UV); instead of expanding the cached latents per head, it is absorbed into
the query and the output (the release's decode path, vLLM's and SGLang's for prefill too):

    q_lat[h] = q_nope[h] @ W_UK[h]                     [kv_lora]: q . k = [q_lat | q_pe] . row
    o_lat[h] = sum_j p_j row_j[:kv_lora]              (V = the latent part of the same rows)
    o[h] = o_lat[h] @ W_UV[h]^T, then wo

so every query reads its rows once through `kernels.sparse_mla_decode` at [heads, 576] with
d_v = 512, prefill and decode alike. wkv_b is kept dense (an FP8 checkpoint's is dequantized at
load, as the release's decode path dequantizes it).

Rows are written to their slots before attention: a row never moves (no window ring), so a
query attends to its own chunk straight from the pool.

Tensor parallel, as the release splits it: each rank holds a contiguous share of the query heads
(wq_b's rows, wkv_b's rows) and wo's matching input columns (row parallel: one fp32 all-reduce);
wq_a, wkv_a, the norms and the indexer are replicated, so every rank writes the whole latent row
(the one KV head serves every query head) and picks the same tokens.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import column_parallel
from dsaserve.engine.models.deepseek_v32.config import KV_GROUP, ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v32.indexer import Indexer
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
        fp8 = quant is not None
        self.layer, self.heads = layer, tp.local(cfg.num_heads)  # this rank's query heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.kv_lora, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.scale = cfg.softmax_scale
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank, fp8)
        # (the low-rank norms' eps is 1e-6 whatever rms_norm_eps says, in HF and the release)
        self.q_norm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.wq_b = column_parallel(linear(cfg.q_lora_rank, self.heads * cfg.qk_head_dim, fp8))
        self.wkv_a = linear(cfg.hidden_size, self.kv_lora + self.rope, fp8)
        self.kv_norm = RMSNorm(self.kv_lora, 1e-6)
        # [heads * (nope + v), kv_lora]: per head W_UK's rows, then W_UV's; always dense
        self.wkv_b = shard(
            torch.nn.Parameter(torch.zeros(self.heads * (self.nope + self.v_dim), self.kv_lora)), 0
        )
        self.wo = linear(self.heads * self.v_dim, cfg.hidden_size, fp8, row_parallel=tp)
        self.indexer = Indexer(cfg, layer, quant)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, step: StepState) -> torch.Tensor:
        """x [N, hidden], slots [N] each row's own slot -> [N, hidden]; writes this layer's
        rows and index keys for the step's tokens."""
        with profiled("attention"):
            return self._forward(x, slots, step)

    def _forward(self, x: torch.Tensor, slots: torch.Tensor, step: StepState) -> torch.Tensor:
        n, pool, inp = x.shape[0], step.pool, step.inp
        cos, sin = step.rope("main")
        cache = pool.groups[KV_GROUP].kv[self.layer]  # [S, 576], or FP8 pages (engine.kv.pool)
        q_residual = self.q_norm(self.wq_a(x))  # [N, q_lora]
        q = kernels.apply_rope(
            self.wq_b(q_residual).view(n, self.heads, self.nope + self.rope), cos, sin
        )  # [N, H, nope + rope]
        kv = self.wkv_a(x)  # [N, kv_lora + rope]
        row = kernels.apply_rope(
            torch.cat((self.kv_norm(kv[:, : self.kv_lora]), kv[:, self.kv_lora :]), dim=-1),
            cos,
            sin,
        )  # [N, 576]
        pool.write(cache, slots, row)
        w_uk, w_uv = self._absorbed()
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk)  # [H, N, kv_lora]
        q = torch.cat((q_lat.transpose(0, 1), q[..., self.nope :]), dim=-1)  # [N, H, 576]
        with profiled("indexer"):
            picked = self.indexer(x, q_residual, slots, step)  # [N, topk] positions
        indices = _slots_of(picked, step)  # [N, topk] int32, -1 = none
        lengths = torch.clamp(inp.positions + 1, max=picked.shape[1]).to(torch.int32)
        with profiled("sparse_mla"):
            out, _ = kernels.sparse_mla_decode(
                q, cache, indices, self.scale, d_v=self.kv_lora, lengths=lengths
            )  # [N, H, kv_lora]
        out = torch.bmm(out.transpose(0, 1), w_uv)  # [H, N, v]
        return self.wo(out.transpose(0, 1).reshape(n, self.heads * self.v_dim))

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV^T [H, kv_lora, v]), views of wkv_b."""
        w = self.wkv_b.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :].transpose(1, 2)


def _slots_of(picked: torch.Tensor, step: StepState) -> torch.Tensor:
    """Token positions [N, K] (-1 = none) of each row's request -> slot ids [N, K] int32."""
    page_size = step.pool.page_size
    parts = [
        kernels.positions_to_slots(picked[rows], tables, page_size)
        for rows, tables in step.row_tables(step.table(KV_GROUP))
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]
