"""The "before" kernels, kept only so benchmarks (and tests, as extra references) can compare;
`in_engine()` runs them in place of the product's inside the engine (kernels.swap_kernels).

- ``sparse_mla_decode``: one program per (request, head), elementwise multiply and sum, no
  tensor cores; every head re-reads the same gathered KV rows.
- ``indexer_topk``: scores a buffer padded to the configured maximum context with an fp32 torch
  bmm, then torch.topk over it, so its cost follows the maximum, not the real lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from dsaserve.kernels.backend import swap_kernels
from dsaserve.kernels.kv_quant import keys_per_page
from dsaserve.kernels.reference import indexer_scores, pick_topk
from dsaserve.kernels.softmax import LOG2E, finalize, normalize, softmax_step
from dsaserve.kernels.sparse_mla import check_decode_args


@triton.jit
def _naive_decode_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_ib, stride_ob, stride_oh, stride_lb,
    num_slots, num_idx, qk_scale,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) + tl.arange(0, 1)  # one head, kept 1-d for the shared helpers
    offs_v = tl.arange(0, D_V)
    n = num_idx
    if HAS_LENGTHS:
        n = tl.minimum(tl.load(len_ptr + b), num_idx)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :]).to(tl.float32)  # [1, D_V]
    if D_ROPE > 0:
        offs_r = D_V + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_row + offs_r[None, :]).to(tl.float32)  # [1, D_ROPE]
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D_V], tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_ptr + b * stride_ib + offs_n, mask=offs_n < n, other=-1)
        valid = (slot >= 0) & (slot < num_slots)
        kv_rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
        kv_nope = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None], other=0.0)
        kv_nope = kv_nope.to(tl.float32)  # [BLOCK_N, D_V]
        s = tl.sum(q_nope * kv_nope, 1)  # [BLOCK_N]
        if D_ROPE > 0:
            k_rope = tl.load(kv_rows + offs_r[None, :], mask=valid[:, None], other=0.0)
            s += tl.sum(q_rope * k_rope.to(tl.float32), 1)
        s = tl.where(valid, s * qk_scale, float("-inf"))[None, :]  # [1, BLOCK_N]
        p, alpha, m, l = softmax_step(s, m, l)
        acc = acc * alpha[:, None] + tl.sum(tl.trans(p) * kv_nope, 0)[None, :]
    o, lse2 = normalize(acc, m, l)
    out, lse = finalize(o, lse2, sink_ptr, heads, HAS_SINKS)
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_v[None, :],
        out.to(out_ptr.dtype.element_ty),
    )
    tl.store(lse_ptr + b * stride_lb + heads, lse)


def sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    sinks: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive sparse-MLA decode; semantics in kernels.dispatch.sparse_mla_decode (plain pools
    only: the "before" kernel has no FP8 variant)."""
    assert kv.dtype != torch.uint8, "the naive decode reads plain pools only"
    d_rope = check_decode_args(q, kv, indices, d_v)
    q, kv = q.contiguous(), kv.contiguous()
    batch, heads, _ = q.shape
    out = torch.empty(batch, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    _naive_decode_kernel[(batch, heads)](
        q, kv, indices,
        lse if lengths is None else lengths,
        lse if sinks is None else sinks,
        out, lse,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        lse.stride(0),
        kv.shape[0], indices.shape[1], sm_scale * LOG2E,
        D_V=d_v, D_ROPE=d_rope, BLOCK_N=16, HAS_LENGTHS=lengths is not None,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )  # fmt: skip
    return out, lse


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:
    """Naive indexer top-k over a buffer padded to max_context (default: the page table's
    width x page size); semantics in kernels.dispatch.indexer_topk."""
    width = max_context or page_table.shape[1] * keys_per_page(k_cache, q.shape[2])
    scores = indexer_scores(q, weights, k_cache, page_table, width, scale)  # [B, width]
    return pick_topk(scores, lengths, topk)


@contextlib.contextmanager
def in_engine() -> Iterator[None]:
    """Every sparse_mla_decode and indexer_topk call of the enclosed code on these kernels (the
    other kernels stay as they are): the engine's "before" configuration."""
    with swap_kernels(sparse_mla_decode=sparse_mla_decode, indexer_topk=indexer_topk):
        yield
