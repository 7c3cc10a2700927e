"""DeepSeek-V3.2's lightning indexer: picks each query's top-k tokens among those it can see.

score(t, s) = sum_h weight[t, h] * relu(q[t, h] . k[s]) * index_head_dim^-0.5 over s <= t, where
q = wq_b(q_residual) per head (the MLA's low-rank query, shared), k = LayerNorm(wk(x)) one key a
token (MQA), both with RoPE on their FIRST qk_rope_head_dim dims in the half-split (NeoX) form:
DeepSeek's fix of 2025-11-17, which HF's DeepseekV32Indexer follows, unlike the interleaved RoPE
of the attention itself. weight = weights_proj(x) * index_n_heads^-0.5.

As the release does before its FP8 cache, q and k are rotated by the orthonormal Hadamard matrix
(Sylvester order, scaled by Di^-0.5): scores do not change (Hq . Hk = q . k) but the keys are
stored rotated, which is what spreads their outliers before `--kv-cache-dtype fp8` quantizes them
(kernels.kv_quant's index-key format, vLLM's DeepSeek-V3.2 indexer cache).

The keys live in the pool's `index_k[layer]`, one per token, written before scoring so that a
query sees its own chunk. Scoring and top-k run in `kernels.indexer_topk`, whose work follows
each row's real context (position + 1 keys). Replicated under tensor parallelism, as V4's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.indexer_topk import step_topk
from dsaserve.engine.models.deepseek_v32.config import KV_GROUP, ModelConfig, Quantization
from dsaserve.engine.step import StepState


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix scaled to be orthonormal (n a power of two), fp32."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h * n**-0.5


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, ..., D] with NeoX RoPE on its first 2 * half channels: halves (a, b) become
    (a c - b s, b c + a s); cos/sin [N, half] in x's dtype. A new tensor."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((a * c - b * s, b * c + a * s, rest), dim=-1)


class Indexer(torch.nn.Module):
    rotation: torch.Tensor  # [Di, Di] the orthonormal Hadamard matrix (a buffer)

    def __init__(self, cfg: ModelConfig, layer: int, quant: Quantization | None = None) -> None:
        super().__init__()
        fp8 = quant is not None
        self.layer, self.topk = layer, cfg.index_topk
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.head_dim, fp8)
        self.wk = linear(cfg.hidden_size, self.head_dim, fp8)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        self.weights_proj = torch.nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.register_buffer("rotation", hadamard(self.head_dim), persistent=False)

    def forward(
        self, x: torch.Tensor, q_residual: torch.Tensor, slots: torch.Tensor, step: StepState
    ) -> torch.Tensor:
        """x [N, hidden], q_residual [N, q_lora], slots [N] each row's own slot -> [N, topk]
        int32 positions of the picked tokens (-1 = none; only position + 1 exist)."""
        pool, inp, n = step.pool, step.inp, x.shape[0]
        cos, sin = step.rope("main")
        q = self.wq_b(q_residual).view(n, self.heads, self.head_dim)
        q = self._rotate(rope_half_split(q, cos, sin))  # [N, Hi, Di]
        k = F.layer_norm(
            self.wk(x).float(), (self.head_dim,), self.k_norm.weight, self.k_norm.bias, 1e-6
        ).to(x.dtype)
        k = self._rotate(rope_half_split(k, cos, sin))  # [N, Di]
        keys = pool.groups[KV_GROUP].index_k[self.layer]  # [slots, Di], or FP8 pages
        pool.write(keys, slots, k)
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [N, Hi]
        lengths = (inp.positions + 1).to(torch.int32)
        # [pages, P, Di], or FP8 pages [pages, P * (Di + 4)] (indexer_topk dequantizes them)
        k_cache = pool.pages_of(keys, pool.groups[KV_GROUP].num_pages)
        tables, scale = step.table(KV_GROUP), self.head_dim**-0.5
        return step_topk(step, tables, q, weights, k_cache, lengths, self.topk, scale)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x @ rotation in fp32 (as the release's hadamard_transform), back in x's dtype."""
        return (x.float() @ self.rotation).to(x.dtype)
