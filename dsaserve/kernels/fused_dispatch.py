"""Public entry points of the fused decode glue: Triton for CUDA tensors, the engine's torch
sequence (kernels.fused_reference) for CPU tensors.

A decode step of DeepSeek-V4 is launch-bound on the small ops between its GEMMs and attention
kernels; each function here is one or two launches where the engine runs 5 to 25. The backend
is kernels.backend's rule, as for every kernel (``kernels.use_backend`` forces one; "triton"
runs on CPU in the interpreter). All Triton paths are free of host
synchronisation and allocate by shape only, so decode steps that use them stay capturable in
CUDA graphs.
"""

from __future__ import annotations

import torch

from dsaserve.kernels import (
    fused_attention,
    fused_compressor,
    fused_indexer,
    fused_indices,
    fused_mhc,
    fused_reference,
)
from dsaserve.kernels.backend import uses_triton
from dsaserve.kernels.compressor_rows import CompressorRows
from dsaserve.kernels.dispatch import store_kv_fp8, store_rows


def compress_decode(rows: CompressorRows, target: torch.Tensor, trash_slot: int) -> None:
    """A compressor's decode rows (kernels.CompressorRows: shapes there): ring update, and the
    entry of every window that closes.

    target       [slots, head_dim] contiguous pool of the entries (kv[layer] or index_k[layer]),
                 or an FP8 pool of them (uint8 pages, kernels.kv_quant: attention entries
                 [pages, P * 584] or index keys [pages, P * (head_dim + 4)], P = page_size).

    Writes kv, gate into ring row positions % ROWS of slab. For each row whose token closes
    window w = pos // rate ((pos + 1) % rate == 0), pools the window's slots j:
    score_j = gate_j + ape_j (per channel; an overlapping compressor pools window w-1's Ca and
    window w's Cb, 2 * rate slots, window -1 masked to -inf), entry = sum_j softmax_j(score) *
    kv_j, RMS-normalised with norm_weight, RoPE (interleaved, trailing rope_dim channels) at
    position w * rate; writes it to slot entry_table[b, w // page_size] * page_size +
    w % page_size of target. The torch path also pools the open windows and writes them to
    `trash_slot`; the Triton path leaves them (and the trash slot) alone.

    An FP8 target gets the same entries quantized on write (kernels.store_rows): the pooling
    kernel hands them over in kv's dtype, with their slots, and the store kernel writes the
    closing windows' only (two launches; still no host sync).
    """
    if target.dtype == torch.uint8:
        if uses_triton(rows.kv):
            entries = rows.kv.new_empty(rows.kv.shape[0], rows.head_dim)
            slots = torch.empty(rows.kv.shape[0], dtype=torch.int64, device=rows.kv.device)
            fused_compressor.compress_decode(rows, None, staged=(entries, slots))
        else:
            entries, slots = fused_reference.compress_decode_entries(rows)
        store_rows(target, slots, entries, rows.page_size)
        return
    if uses_triton(rows.kv):
        fused_compressor.compress_decode(rows, target)
    else:
        fused_reference.compress_decode(rows, target, trash_slot)


def indexer_query(
    q: torch.Tensor,
    weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lightning indexer's per-row inputs of kernels.indexer_topk, in one launch.

    q          [N, Hi, Di] contiguous: wq_b(q_residual) viewed per head, the model dtype.
               Consumed: the Triton path rotates it in place and returns it.
    weights    [N, Hi] weights_proj(x), any float dtype, contiguous.
    cos, sin   [N, rope_dim // 2] the rows' "compress" RoPE table, the model dtype.
    positions  [N] int64; rate the layer's compress rate.

    Returns (q with interleaved RoPE on its trailing rope_dim channels [N, Hi, Di],
    weights.float() * Hi ** -0.5 [N, Hi] fp32, lengths = (positions + 1) // rate [N] int32,
    the entries each row may see).
    """
    impl = fused_indexer.indexer_query if uses_triton(q) else fused_reference.indexer_query
    return impl(q, weights, cos, sin, positions, rate)


def sparse_indices(
    positions: torch.Tensor,
    row_req: torch.Tensor,
    req_past: torch.Tensor,
    req_row0: torch.Tensor,
    table: torch.Tensor,
    *,
    ring_pages: int,
    page_size: int,
    scratch_base: int,
    window: int,
    picked: torch.Tensor | None = None,
    hca_ratio: int = 0,
    hca_width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's sparse-MLA index lists and lengths for every row of a step, in one launch.

    positions   [N] int64 row positions; row_req [N] int64 each row's request;
    req_past    [B] int64 tokens each request computed before this step;
    req_row0    [B] int64 each request's first row (StepInputs' fields).
    table       [B, pages] int32 page tables of the layer's group, row = request:
                ring_pages ring pages, then the compressed-entry pages (StepState.table).
    scratch_base  first scratch row of the group's slot space (KVPool.entry_slot_base).
    window      sliding window W (cfg.sliding_window).
    picked      CSA: [N, K] int32 entry positions from kernels.indexer_topk (-1 = none).
    hca_ratio, hca_width
                HCA: the compress rate and the entry columns (>= every row's entry count; the
                engine sizes them from StepInputs.max_position).

    Returns int32 indices [N, W + K] (CSA), [N, W + hca_width] (HCA) or [N, W], and lengths
    [N] int32 (HCA: W + (pos + 1) // hca_ratio, else None). Column j < W: the slot of key
    position t - W + 1 + j of row t: -1 before position 0, the row's scratch row
    scratch_base + req_row0 + (key - req_past) for keys computed in this step, else its ring
    slot table[req, (key % ring_len) // P] * P + key % P (ring_len = ring_pages * P). Columns
    past W: entry e (picked, or 0..count-1 for HCA, -1 beyond) at slot
    table[req, ring_pages + e // P] * P + e % P, -1 staying -1.
    """
    impl = (
        fused_indices.sparse_indices if uses_triton(positions) else fused_reference.sparse_indices
    )
    return impl(
        positions,
        row_req,
        req_past,
        req_row0,
        table,
        ring_pages=ring_pages,
        page_size=page_size,
        scratch_base=scratch_base,
        window=window,
        picked=picked,
        hca_ratio=hca_ratio,
        hca_width=hca_width,
    )


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mHC write-back after a sublayer, in one launch.

    streams [N, n, D] contiguous, the model dtype; out [N, D] the sublayer's output, same dtype;
    post [N, n] and comb [N, n, n] fp32 (from hc_pre). Returns new streams [N, n, D]:
    new[:, j] = post_j * out + sum_i comb[i, j] * streams[:, i], with post and comb rounded to
    the model dtype first and each of the two terms rounded to it (the engine's
    merge_streams: a broadcast product plus a batched matmul).
    """
    impl = fused_mhc.hc_merge if uses_triton(streams) else fused_reference.hc_merge
    return impl(streams, out, post, comb)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer (optionally after the previous one's write-back), in two launches.

    streams      [N, n, D] contiguous, the model dtype (n a power of two).
    fn, base, scale  HyperConnection's parameters: [(2 + n) * n, n * D], [(2 + n) * n], [3], fp32.
    norm_weight  [D] fp32 weight of the sublayer's input RMSNorm (attn_norm / ffn_norm).
    iters, hc_eps    Sinkhorn sweeps and eps (kernels.hc_weights); norm_eps the eps of both RMS
                 norms (the flattened streams' unweighted one and norm_weight's; the model uses
                 rms_norm_eps for both).
    merge        None, or (out [N, D], post [N, n], comb [N, n, n]) of the previous sublayer:
                 the streams are first replaced by hc_merge(streams, *merge).

    Returns (streams [N, n, D] (the merged ones, or the input itself), post [N, n] fp32,
    comb [N, n, n] fp32, x [N, D] the model dtype): mixes = rms_norm(flatten(streams)) @ fn^T in
    fp32, (pre, post, comb) = kernels.hc_weights(mixes, ...), x = RMSNorm(sum_i pre_i *
    streams[:, i]) with norm_weight. The Triton path computes mixes as
    (flatten(streams) @ fn^T) * rsqrt(mean square + eps), reading each stream element once.
    """
    impl = fused_mhc.hc_pre if uses_triton(streams) else fused_reference.hc_pre
    return impl(streams, fn, base, scale, norm_weight, iters, hc_eps, norm_eps, merge)


def attention_pre(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    scratch_slots: torch.Tensor,
    ring_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's query and key/value rows after their projections, in one launch.

    q             [N, H, D] contiguous wq_b output, the model dtype.
    kv            [N, D] contiguous wkv output; kv_weight [D] fp32 its RMSNorm's weight.
    cos, sin      [N, rope_dim // 2] the rows' RoPE table (the layer's kind), the model dtype.
    cache         [slots, D] contiguous: the layer's slot space (KVPool kv[layer]); or an FP8
                  pool of it (uint8 [pages, P * 584], kernels.kv_quant; D = 512): the kv rows
                  are then quantized on write (store_kv_fp8, one more launch per slot list).
    scratch_slots [N] int64 every row's scratch slot (StepState.scratch_slots).
    ring_slots    [M] int64, M <= N: ring slots of rows 0..M-1, which are written there too.
                  Pass the decode rows' (StepState.persist_slots(group)[:num_decode]): a decode
                  row's ring slot holds a position outside every window of this step, so it can
                  be persisted before attention; prefill rows must still persist after it.

    Returns q = RoPE(q / rms(q)) per head [N, H, D] and kv = RoPE(RMSNorm(kv)) [N, D] (norm
    statistics in fp32, rounded to the model dtype before the rotation, as the engine's two
    kernels round), and writes kv rows to cache[scratch_slots] and cache[ring_slots].
    """
    impl = fused_attention.attention_pre if uses_triton(q) else fused_reference.attention_pre
    if cache.dtype != torch.uint8:
        return impl(q, kv, kv_weight, eps, cos, sin, cache, scratch_slots, ring_slots)
    q, kv = impl(q, kv, kv_weight, eps, cos, sin, None, scratch_slots, ring_slots)
    store_kv_fp8(cache, scratch_slots, kv)
    store_kv_fp8(cache, ring_slots, kv[: ring_slots.shape[0]])
    return q, kv


def attention_post(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse RoPE of the attention output before wo_a, touching only the rope channels.

    out [N, H, D] contiguous (sparse_mla_decode's output), consumed: the Triton path rotates its
    trailing rope_dim channels in place and returns it. cos, sin [N, rope_dim // 2] the rows'
    table, out's dtype. Returns out with its rope channels rotated by minus the angle.
    """
    impl = fused_attention.attention_post if uses_triton(out) else fused_reference.attention_post
    return impl(out, cos, sin)
