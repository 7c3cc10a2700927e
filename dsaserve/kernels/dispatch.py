"""Public entry points of the attention, indexer, KV-store, mHC and row-wise kernels: Triton or
the torch reference by kernels.backend's rule (Triton for CUDA tensors; tests force a backend
with ``kernels.use_backend``, and without CUDA Triton runs in its interpreter, kernels.env).
"""

from __future__ import annotations

import torch

from dsaserve.kernels import indexer, kv_quant, mhc, reference, rowwise, sparse_mla
from dsaserve.kernels.backend import forced, swapped, uses_gluon, uses_triton


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
    """Sparse MLA attention of each row's query heads over its own list of KV slots.

    q        [B, H, D] bf16 (fp16/fp32/float64 accepted; float64 on the reference only); H a
             multiple of 16, D = d_v + rope width (512 or 576 with d_v = 512).
    kv       [S, D], q's dtype: one row per slot of a layer's pool, one KV head shared by all
             query heads; K = the whole row, V = its first d_v columns. Or an FP8 pool
             (kernels.kv_quant, S = num_pages * P slots, slot s at page s // P, row s % P),
             every row read as its exact dequantization, q bf16/fp16/fp32: uint8
             [num_pages, P * 584] (V4: 448 e4m3 + 64 bf16 values and 7 ue8m0 scales a row;
             D = d_v = 512, K = V = the whole row) or [num_pages, P * 656] (V3.2: 512 e4m3 with
             4 fp32 scales + 64 bf16 values a row; D = 576, d_v = 512).
    indices  [B, K] int32 slot ids; -1 (or any id outside [0, S)) is skipped, anywhere.
    sm_scale softmax scale applied to q . K.
    sinks    [H] fp32 or None: per-head sink logit added to the softmax denominator.
    lengths  [B] int32 or None: only indices[b, :lengths[b]] are read; no work past them.

    Returns out [B, H, d_v] in q's dtype, out[b, h] = sum_j p_j V_j with
    p_j = exp(s_j) / (sum_i exp(s_i) + exp(sinks[h])), s_j = sm_scale * q[b, h] . K_j over the
    valid j, and lse [B, H] fp32 = natural log of sum_j exp(s_j) (sink excluded). A row with no
    valid index gives out = 0 and lse = -inf. Decode (B requests) and prefill (B prompt tokens,
    each with its own index list) use the same call. On sm_90 the shapes kernels.hopper.sparse_mla
    takes run its Gluon kernel (kernels.backend.uses_gluon).
    """
    impl = swapped("sparse_mla_decode")
    if impl is None and uses_gluon(q):
        from dsaserve.kernels.hopper import sparse_mla as hopper_mla

        if hopper_mla.supports(q, kv, d_v):
            impl = hopper_mla.sparse_mla_decode
    if impl is None:
        # The reference also where the kernel's tiles do not fit the shape, unless Triton is
        # forced: e.g. the tiny demo model's 4 heads on a GPU; graph-safe too.
        fits = forced() is not None or sparse_mla.supports(q.shape[1], q.shape[2], d_v)
        triton = uses_triton(q) and fits
        impl = sparse_mla.sparse_mla_decode if triton else reference.sparse_mla_decode
    return impl(q, kv, indices, sm_scale, d_v=d_v, sinks=sinks, lengths=lengths)


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
    """Lightning-indexer top-k over each row's real context.

    q           [B, Hi, Di] indexer queries (RoPE applied), k_cache's dtype (bf16/fp16/fp32
                with an FP8 pool).
    weights     [B, Hi] fp32.
    k_cache     [num_pages, P, Di] paged keys, or an FP8 pool uint8 [num_pages, P * (Di + 4)]
                (kernels.kv_quant: Di e4m3 codes and one fp32 scale a key), read as its exact
                dequantization.
    page_table [B, max_pages] int32; lengths [B] int32.

    Entry j of row b (j < lengths[b]) is k_cache[page_table[b, j // P], j % P], scored
    sum_h weights[b, h] * relu(q[b, h] . k_j) * scale. Returns int32 [B, topk]: the positions j
    of the top-topk scores in any order (ties broken arbitrarily); when lengths[b] <= topk,
    0..lengths[b]-1 then -1, without scoring. Map positions to slot ids with
    kernels.positions_to_slots. Work and memory scaling of the CUDA path: kernels.indexer.
    """
    impl = swapped("indexer_topk") or (
        indexer.indexer_topk if uses_triton(q) else reference.indexer_topk
    )
    return impl(q, weights, k_cache, page_table, lengths, topk, scale=scale)


def store_kv_fp8(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize-on-write of attention rows: kv [N, 512] (V4's entries) or [N, 576] (V3.2's
    latent rows), bf16 (fp16/fp32 accepted), into slots [N] (int32/int64) of an FP8 pool uint8
    [num_pages, P * 584] or [num_pages, P * 656], in place.

    Row i goes to slot slots[i] (page slots[i] // P, row slots[i] % P) in kernels.kv_quant's
    layout of that width; slots outside [0, num_pages * P) are skipped; a slot named twice gets
    one of its rows. The CUDA path (one program per 16-32 rows and value group) reads nothing
    back to the host, so it runs inside captured decode graphs."""
    if kv.shape[-1] == kv_quant.V32_DIM:
        impl = kv_quant.store_kv_v32 if uses_triton(kv) else kv_quant.store_kv_v32_reference
    else:
        impl = kv_quant.store_kv if uses_triton(kv) else kv_quant.store_kv_reference
    impl(pool, slots, kv)


def store_index_k_fp8(pool: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Quantize-on-write of indexer keys: keys [N, Di] into slots [N] of an FP8 pool uint8
    [num_pages, P * (Di + 4)] (kernels.kv_quant), in place; slots outside [0, num_pages * P) are
    skipped. Graph-safe on CUDA like store_kv_fp8."""
    impl = kv_quant.store_index_k if uses_triton(keys) else kv_quant.store_index_k_reference
    impl(pool, slots, keys)


def store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, page_size: int) -> None:
    """Write rows [N, D] into slots [N] of a layer's pool, whichever its format: a plain pool
    [slots, D] (rows' dtype; index_copy_, every slot valid), or an FP8 pool with page_size slots
    a page, told apart by its page width: P * 584 bytes holds V4's attention entries (D = 512)
    and P * 656 V3.2's latent rows (D = 576, store_kv_fp8), P * (D + 4) index keys
    (store_index_k_fp8); there slots outside the pool are skipped."""
    attention = rows.shape[1] in (kv_quant.KV_DIM, kv_quant.V32_DIM)
    if pool.dtype != torch.uint8:
        pool.index_copy_(0, slots, rows)
    elif attention and pool.shape[1] == page_size * kv_quant.kv_token_bytes(rows.shape[1]):
        store_kv_fp8(pool, slots, rows)
    else:
        assert pool.shape[1] == page_size * kv_quant.index_token_bytes(rows.shape[1]), (
            f"an FP8 pool of {pool.shape[1]} bytes a page holds neither {page_size} attention "
            f"entries nor {page_size} index keys of {rows.shape[1]} values"
        )
        store_index_k_fp8(pool, slots, rows)


def copy_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, page_size: int) -> None:
    """Copy the rows at slots src [N] of a layer's attention pool to slots dst [N], bytes as they
    are: a plain pool [slots, D], or an FP8 one (kernels.kv_quant: a row's data and scale bytes
    lie apart in its page). Reads all of src before writing dst."""
    if pool.dtype != torch.uint8:
        pool.index_copy_(0, dst, pool.index_select(0, src))
        return
    assert pool.shape[1] == page_size * kv_quant.KV_TOKEN_BYTES, "not an FP8 attention pool"
    for part in kv_quant.kv_views(pool):  # [pages, P, bytes] each
        part[dst // page_size, dst % page_size] = part[src // page_size, src % page_size]


def hc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights from projected mixes [R, (2+n)*n] fp32: pre [R, n], post [R, n], comb [R, n, n].

    pre = sigmoid(m[:n]*scale[0] + base[:n]) + eps; post = 2*sigmoid(m[n:2n]*scale[1] + base[n:2n]);
    comb = row softmax of m[2n:].view(n, n)*scale[2] + base[2n:], plus eps, then `iters` Sinkhorn
    sweeps (columns first, ending on columns).
    """
    impl = mhc.hc_weights if uses_triton(mixes) else reference.hc_weights
    return impl(mixes, base, scale, n, iters, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] / rms(x) over D (statistics in fp32), times `weight` [D] fp32 if given."""
    impl = rowwise.rms_norm if uses_triton(x) else reference.rms_norm
    return impl(x, weight, eps)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2*half channels of x [N, ..., D]: pairs (x0, x1) become
    (x0 c - x1 s, x1 c + x0 s) with cos/sin [N, half] per row N (x's dtype, math in fp32);
    `inverse` rotates by minus the angle. The leading channels pass through."""
    impl = rowwise.apply_rope if uses_triton(x) else reference.apply_rope
    return impl(x, cos, sin, inverse)
