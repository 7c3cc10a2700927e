"""Plain-torch references: the CPU path of the engine and the yardstick of the tests.

Vectorised over rows (gather + einsum), computed in fp32, or in float64 when given float64 inputs,
so fp32 inputs give exact results. FP8 pools (uint8, kernels.kv_quant) are read through their
exact dequantization. They synchronise with the host and allocate by data (``lengths.max()``),
so they are not for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.kernels import kv_quant
from dsaserve.kernels.paging import positions_to_slots


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    sinks: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse-MLA decode; semantics in kernels.dispatch.sparse_mla_decode.

    compute_dtype overrides the arithmetic type (benchmarks time a bf16 variant)."""
    dtype = compute_dtype or _compute_dtype(q.dtype)
    fp8 = kv.dtype == torch.uint8  # an FP8 pool: rows are dequantized as they are gathered
    dim = q.shape[-1]  # an FP8 pool's format follows from it (kernels.kv_quant)
    num_slots = kv.shape[0] * (kv_quant.kv_page_size(kv, dim) if fp8 else 1)
    num_idx = indices.shape[1]
    valid = (indices >= 0) & (indices < num_slots)  # [B, K]
    if lengths is not None:
        valid &= torch.arange(num_idx, device=indices.device) < lengths[:, None]
    slots = indices.long().clamp(0, num_slots - 1)
    rows = (kv_quant.gather_kv(kv, slots, dim) if fp8 else kv[slots]).to(dtype)  # [B, K, D]
    scores = torch.einsum("bhd,bkd->bhk", q.to(dtype), rows) * sm_scale  # [B, H, K]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]; -inf for a row without valid entries
    probs = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0.0)[..., None])
    if sinks is not None:  # exp(lse) / (exp(lse) + exp(sink))
        probs = probs * torch.sigmoid(lse - sinks.to(dtype))[..., None]
    out = torch.einsum("bhk,bkd->bhd", probs, rows[..., :d_v])  # [B, H, d_v]
    return out.to(q.dtype), lse.float()


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """Scores of positions 0..width-1 of every row, [B, width], in fp32 (float64 for float64).

    Positions past a row's length read whatever its page table points at; callers mask them."""
    batch, _, head_dim = q.shape
    dtype = _compute_dtype(q.dtype)
    fp8 = k_cache.dtype == torch.uint8  # an FP8 pool: keys are dequantized as they are gathered
    page_size = kv_quant.keys_per_page(k_cache, head_dim)
    num_slots = k_cache.shape[0] * page_size
    positions = torch.arange(width, device=q.device).expand(batch, width)
    slots = positions_to_slots(positions, page_table, page_size).long().clamp(0, num_slots - 1)
    if fp8:
        keys = kv_quant.gather_index_k(k_cache, slots, head_dim).to(dtype)  # [B, width, Di]
    else:
        keys = k_cache.reshape(-1, head_dim)[slots].to(dtype)  # [B, width, Di]
    logits = torch.bmm(q.to(dtype), keys.transpose(1, 2)).relu()  # [B, Hi, width]
    return (logits * weights.to(dtype)[..., None]).sum(1) * scale


def pick_topk(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k positions of scores [B, W] among j < lengths[b]; 0..len-1 and -1 padding when
    lengths[b] <= topk. Returns int32 [B, topk]."""
    width = scores.shape[1]
    ramp = torch.arange(max(width, topk), device=scores.device)
    masked = scores.masked_fill(ramp[:width] >= lengths[:, None], float("-inf"))
    kept = min(topk, width)
    top = F.pad(masked.topk(kept, dim=1).indices, (0, topk - kept), value=-1)  # [B, topk]
    short = torch.where(ramp[:topk] < lengths[:, None], ramp[:topk], -1)
    return torch.where(lengths[:, None] <= topk, short, top).to(torch.int32)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    scale: float,
) -> torch.Tensor:
    """Reference indexer top-k; semantics in kernels.dispatch.indexer_topk. Scores only up to
    the longest row (one host sync) and only rows longer than topk."""
    # no scores at all: the short rows' answer, and -1 rows to fill in below
    out = pick_topk(lengths.new_zeros(lengths.shape[0], 0, dtype=torch.float32), lengths, topk)
    long_rows = (lengths > topk).nonzero().flatten()
    if long_rows.numel() == 0:
        return out
    width = int(lengths[long_rows].max())
    scores = indexer_scores(
        q[long_rows], weights[long_rows], k_cache, page_table[long_rows], width, scale
    )
    out[long_rows] = pick_topk(scores, lengths[long_rows], topk)
    return out


def hc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference mHC weights; semantics in kernels.mhc (the exact order of HF transformers' ops)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Reference RMS norm (HF's op order: weighted norms scale in fp32 and cast once; the
    unweighted one casts the rsqrt factor to x's dtype first)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Reference interleaved RoPE of the trailing 2*half channels of x [N, ..., D]."""
    half = cos.shape[-1]
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(view).float(), sin.reshape(view).float()
    if inverse:
        sin = -sin
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
