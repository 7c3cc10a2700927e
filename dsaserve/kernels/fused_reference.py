"""Plain-torch references of the fused decode glue: the engine's own op sequences.

Each function is lifted from the model code it replaces (engine/models/deepseek_v4/compressor.py,
indexer.py, mhc.py, attention.py and engine/step.py's index lists), op for op, so that swapping
the engine's code for kernels.fused_dispatch changes no numbers beyond rounding. They call the
dispatching rms_norm / apply_rope / hc_weights as the engine does: on CPU tensors those are
kernels.reference, on CUDA tensors the row-wise Triton kernels, so on a GPU each function here
IS the engine's current sequence (bench/glue.py times it as the baseline). No host sync and
shapes fixed by the inputs: they can be captured in CUDA graphs too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.kernels.compressor_rows import CompressorRows
from dsaserve.kernels.dispatch import apply_rope, hc_weights, rms_norm
from dsaserve.kernels.paging import positions_to_slots


def compress_decode(rows: CompressorRows, target: torch.Tensor, trash_slot: int) -> None:
    """Compressor._decode_rows (semantics in kernels.fused_dispatch.compress_decode)."""
    entries, slots = compress_decode_entries(rows)
    target.index_copy_(0, torch.where(slots >= 0, slots, trash_slot), entries)


def compress_decode_entries(rows: CompressorRows) -> tuple[torch.Tensor, torch.Tensor]:
    """compress_decode up to the write: updates the ring, returns (entries [D, head_dim] in kv's
    dtype, one per row (open windows pooled too), their slots [D] int64, -1 where the window
    stays open)."""
    kv, gate, positions, slab = rows.kv, rows.gate, rows.positions, rows.slab
    ring_kv, ring_gate, page_size, entry_table = (
        rows.ring_kv,
        rows.ring_gate,
        rows.page_size,
        rows.entry_table,
    )
    rate, ring_rows = rows.rate, ring_kv.shape[1]
    ring_kv[slab, positions.remainder(ring_rows)] = kv
    ring_gate[slab, positions.remainder(ring_rows)] = gate
    window = torch.div(positions, rate, rounding_mode="floor")  # [D]
    cur_rows = (window * rate)[:, None] + torch.arange(rate, device=positions.device)  # [D, rate]
    cur = (
        ring_kv[slab[:, None], cur_rows.remainder(ring_rows)],
        ring_gate[slab[:, None], cur_rows.remainder(ring_rows)],
    )
    prev = None
    if kv.shape[1] == 2 * rows.head_dim:  # overlap: window w-1 joins window w
        prev_rows = (cur_rows - rate).remainder(ring_rows)
        prev = (ring_kv[slab[:, None], prev_rows], ring_gate[slab[:, None], prev_rows], window >= 1)
    entries = pool_windows(
        cur, prev, rows.ape, rows.norm_weight, rows.eps, rows.inv_freq, window * rate
    )
    closes = (positions + 1).remainder(rate) == 0
    entry = torch.where(closes, window, 0)
    req = torch.arange(positions.shape[0], device=positions.device)
    page = entry_table[req, torch.div(entry, page_size, rounding_mode="floor")].long()
    slots = page * page_size + entry.remainder(page_size)
    return entries, torch.where(closes, slots, -1)


def pool_windows(
    cur: tuple[torch.Tensor, torch.Tensor],
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    first_pos: torch.Tensor,
) -> torch.Tensor:
    """Compressor._pool, the entries of M closing windows (prefill chunks use it as it is).

    cur = (kv, gate) [M, rate, F] of the windows; prev = (kv, gate) [M, rate, F] of the windows
    before them and a [M] bool validity mask (overlapping compressors), else None; ape
    [rate, F] fp32; norm_weight [head_dim] fp32; inv_freq [rope_dim // 2] fp32 the "compress"
    RoPE table's; first_pos [M] int64 each window's first position. Returns [M, head_dim]:
    softmax(gate + ape)-weighted sums over the slots (2 * rate with overlap: Ca of the previous
    window, Cb of this one), RMS-normalised, RoPE at first_pos, in kv's dtype.
    """
    d, rate = norm_weight.shape[0], ape.shape[0]
    if prev is None:
        kv, score = cur[0], cur[1] + ape
    else:
        kv = torch.cat((prev[0][..., :d], cur[0][..., d:]), dim=1)  # [M, 2*rate, d]
        score = torch.cat((prev[1][..., :d] + ape[:, :d], cur[1][..., d:] + ape[:, d:]), dim=1)
        score[:, :rate] = score[:, :rate].masked_fill(~prev[2][:, None, None], float("-inf"))
    weights = score.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = rms_norm((kv * weights).sum(dim=1), norm_weight, eps)
    freqs = first_pos.to(torch.float32)[:, None] * inv_freq[None, :]  # as RotaryTable does
    return apply_rope(pooled, freqs.cos().to(pooled.dtype), freqs.sin().to(pooled.dtype))


def indexer_query(
    q: torch.Tensor,
    weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexer.forward's query side (semantics in kernels.fused_dispatch.indexer_query)."""
    lengths = torch.div(positions + 1, rate, rounding_mode="floor").to(torch.int32)
    return apply_rope(q, cos, sin), weights.float() * weights.shape[1] ** -0.5, lengths


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
    """StepState.window_indices / hca_indices, Indexer's positions_to_slots and Attention's
    concatenation (semantics in kernels.fused_dispatch.sparse_indices)."""
    P, N = page_size, positions.shape[0]
    keys = positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)
    req = row_req[:, None]
    past = req_past[req]
    scratch = scratch_base + req_row0[req] + (keys - past)
    ring = keys.clamp(min=0).remainder(ring_pages * P)
    ring = table[req, torch.div(ring, P, rounding_mode="floor")].long() * P + ring.remainder(P)
    indices = torch.where(keys >= 0, torch.where(keys >= past, scratch, ring), -1)  # [N, W]
    lengths = None
    if picked is not None:
        picked = positions_to_slots(picked, table[:, ring_pages:][row_req], P)
        indices = torch.cat((indices, picked), dim=1)
    elif hca_ratio:
        counts = torch.div(positions + 1, hca_ratio, rounding_mode="floor")
        entry = torch.arange(hca_width, device=positions.device)[None, :].expand(N, -1)
        visible = entry < counts[:, None]
        entry = torch.where(visible, entry, 0)
        page = table[req, ring_pages + torch.div(entry, P, rounding_mode="floor")].long()
        entries = torch.where(visible, page * P + entry.remainder(P), -1)
        indices, lengths = torch.cat((indices, entries), dim=1), (counts + window).to(torch.int32)
    return indices.to(torch.int32), lengths


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mhc.merge_streams (semantics in kernels.fused_dispatch.hc_merge)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


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
    """merge_streams, HyperConnection.forward and the block's RMSNorm of the collapsed input
    (semantics in kernels.fused_dispatch.hc_pre)."""
    if merge is not None:
        streams = hc_merge(streams, *merge)
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())  # [N, (2 + n) * n]
    pre, post, comb = hc_weights(mixes, base, scale, streams.shape[1], iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return streams, post, comb, rms_norm(collapsed, norm_weight, norm_eps)


def attention_pre(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None,
    scratch_slots: torch.Tensor,
    ring_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention._forward before the compressor (semantics in
    kernels.fused_dispatch.attention_pre)."""
    q = apply_rope(rms_norm(q, None, eps), cos, sin)  # [N, H, D]
    kv = apply_rope(rms_norm(kv, kv_weight, eps), cos, sin)  # [N, D]
    if cache is not None:  # (None: an FP8 pool, which the dispatcher writes)
        cache.index_copy_(0, scratch_slots, kv)
        cache.index_copy_(0, ring_slots, kv[: ring_slots.shape[0]])
    return q, kv


def attention_post(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention._forward's inverse RoPE of the attention output (semantics in
    kernels.fused_dispatch.attention_post)."""
    return apply_rope(out, cos, sin, inverse=True)
