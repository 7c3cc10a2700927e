"""The compressors' decode path in one launch: ring update, gated pooling, RMS norm, RoPE, write.

Per decode row (one new token of one request) a program
1. writes the token's raw projections (kv, gate) [F] into its ring row pos % rows of the
   request's slab row;
2. if the token closes window w = pos // rate ((pos + 1) % rate == 0), pools the window:
   per channel c, softmax over the window's slots of gate + ape, then sum_j weight_j * kv_j;
   overlapping (CSA) compressors pool 2*rate slots: window w-1's first feature half (Ca) and
   window w's second half (Cb), window w-1 masked out for w = 0;
3. RMS-normalises the entry (fp32 weight), applies RoPE at the window's first position w*rate
   (cos/sin computed in the kernel from the table's inverse frequencies, as RotaryTable computes
   them), and writes it to entry slot w of the request: entry_table[b, w // P] * P + w % P
   (for an FP8 pool, STAGE: to row b of a staging tensor, with that slot beside it, which
   kernels.store_rows then quantizes into the pool).
Rows whose window stays open stop after step 1: nothing is pooled and nothing is written to the
pool (the engine's torch sequence pools every row and sends the open ones to a trash slot). The
new token's own slot is read from the kv/gate inputs, never from the ring row this program just
wrote, so no ordering between the threads of a program is needed.

Rounding follows the engine's torch ops: softmax weights, the products kv * weight, the pooled
sum and the normalised entry are rounded to the model dtype where the engine stores them.
Grid (D,), no host synchronisation, allocations none: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.compressor_rows import CompressorRows
from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.fused_common import cos_sin, halves, rotate, round_to


@triton.jit
def _window_tile(
    ring_ptr, new_ptr, ape_ptr, i, p, first, pos, SCORE: tl.constexpr, W, COL_OFF, RATE, ROWS, F, HD
):
    """Slots i [BLOCK_W] of the pooled window, channel pairs p [BLOCK_P] -> (even, odd) fp32
    [BLOCK_W, BLOCK_P]: the raw kv values, or with SCORE the scores gate + ape (-inf for slots
    before position 0 or past W). Slots below RATE of an overlapping window read the first
    feature half (Ca), the others the second (COL_OFF = head_dim; 0 without overlap)."""
    tok = first + i  # position of the token in slot i
    live = (i < W) & (tok >= 0)
    pair = (p < HD // 2)[None, :]
    new = (tok == pos)[:, None] & pair  # this step's token: read from the inputs, not the ring
    old = (live & (tok != pos))[:, None] & pair
    col = tl.where(i >= RATE, COL_OFF, 0)[:, None] + 2 * p[None, :]  # [BLOCK_W, BLOCK_P]
    here = ring_ptr + ((tl.where(live, tok, 0) % ROWS) * F)[:, None] + col
    x0 = tl.load(here, mask=old, other=0.0).to(tl.float32)
    x1 = tl.load(here + 1, mask=old, other=0.0).to(tl.float32)
    x0 += tl.load(new_ptr + col, mask=new, other=0.0).to(tl.float32)
    x1 += tl.load(new_ptr + col + 1, mask=new, other=0.0).to(tl.float32)
    if SCORE:
        bias = ape_ptr + (i % RATE)[:, None] * F + col
        ok = live[:, None] & pair
        x0 = tl.where(live[:, None], x0 + tl.load(bias, mask=ok, other=0.0), float("-inf"))
        x1 = tl.where(live[:, None], x1 + tl.load(bias + 1, mask=ok, other=0.0), float("-inf"))
    return x0, x1


@triton.jit
def _compress_decode_kernel(
    kv_ptr,  # [D, F] this step's kv projections (row stride kv_stride)
    gate_ptr,  # [D, F] gate projections (row stride gate_stride)
    pos_ptr,  # [D] int64 positions
    slab_ptr,  # [D] int64 slab rows
    ring_kv_ptr,  # [seqs, ROWS, F] (seq stride ring_kv_stride: a slab row's slice)
    ring_gate_ptr,  # [seqs, ROWS, F] (seq stride ring_gate_stride)
    ape_ptr,  # [RATE, F] fp32 per-slot gate bias
    w_ptr,  # [HD] fp32 norm weight
    inv_freq_ptr,  # [HALF] fp32 RoPE inverse frequencies
    table_ptr,  # [B, pages] int32 entry pages of each request (row b = decode row b)
    out_ptr,  # [slots, HD] the pool the entries go to; STAGE: [D, HD] one row per decode row
    slot_ptr,  # STAGE: [D] int64 the entry's slot, -1 where the window stays open
    kv_stride, gate_stride, ring_kv_stride, ring_gate_stride, table_stride, page_size, eps,
    RATE: tl.constexpr, ROWS: tl.constexpr, F: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
    OVERLAP: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr,
    PRECISE: tl.constexpr, STAGE: tl.constexpr,
):  # fmt: skip
    DTYPE: tl.constexpr = ring_kv_ptr.dtype.element_ty
    W: tl.constexpr = 2 * RATE if OVERLAP else RATE  # slots a window pools
    COL_OFF: tl.constexpr = HD if OVERLAP else 0  # where window w's own features (Cb) start
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    slab = tl.load(slab_ptr + b)
    ring_kv = ring_kv_ptr + slab * ring_kv_stride
    ring_gate = ring_gate_ptr + slab * ring_gate_stride
    new_kv = kv_ptr + b * kv_stride
    new_gate = gate_ptr + b * gate_stride
    f = tl.arange(0, BLOCK_F)
    at = (pos % ROWS) * F + f
    tl.store(ring_kv + at, tl.load(new_kv + f, mask=f < F), mask=f < F)
    tl.store(ring_gate + at, tl.load(new_gate + f, mask=f < F), mask=f < F)
    if STAGE:
        tl.store(slot_ptr + b, -1)  # replaced below when the window closes
    if (pos + 1) % RATE == 0:
        window = pos // RATE
        first = window * RATE  # position of slot 0
        if OVERLAP:
            first -= RATE  # window w-1 comes first
        p = tl.arange(0, BLOCK_P)  # channel pairs (2p, 2p+1)
        # softmax over the window's slots, per channel, in the torch order: max, sum, divide
        m0 = tl.full((BLOCK_P,), float("-inf"), tl.float32)
        m1 = tl.full((BLOCK_P,), float("-inf"), tl.float32)
        for w0 in range(0, W, BLOCK_W):
            i = w0 + tl.arange(0, BLOCK_W)
            s0, s1 = _window_tile(
                ring_gate, new_gate, ape_ptr, i, p, first, pos, True, W, COL_OFF, RATE, ROWS, F, HD
            )
            m0 = tl.maximum(m0, tl.max(s0, axis=0))
            m1 = tl.maximum(m1, tl.max(s1, axis=0))
        l0 = tl.zeros((BLOCK_P,), tl.float32)
        l1 = tl.zeros((BLOCK_P,), tl.float32)
        for w0 in range(0, W, BLOCK_W):
            i = w0 + tl.arange(0, BLOCK_W)
            s0, s1 = _window_tile(
                ring_gate, new_gate, ape_ptr, i, p, first, pos, True, W, COL_OFF, RATE, ROWS, F, HD
            )
            l0 += tl.sum(tl.exp(s0 - m0[None, :]), axis=0)
            l1 += tl.sum(tl.exp(s1 - m1[None, :]), axis=0)
        acc0 = tl.zeros((BLOCK_P,), tl.float32)
        acc1 = tl.zeros((BLOCK_P,), tl.float32)
        for w0 in range(0, W, BLOCK_W):
            i = w0 + tl.arange(0, BLOCK_W)
            s0, s1 = _window_tile(
                ring_gate, new_gate, ape_ptr, i, p, first, pos, True, W, COL_OFF, RATE, ROWS, F, HD
            )
            v0, v1 = _window_tile(
                ring_kv, new_kv, ape_ptr, i, p, first, pos, False, W, COL_OFF, RATE, ROWS, F, HD
            )
            g0 = round_to(tl.exp(s0 - m0[None, :]) / l0[None, :], DTYPE)
            g1 = round_to(tl.exp(s1 - m1[None, :]) / l1[None, :], DTYPE)
            acc0 += tl.sum(round_to(v0 * g0, DTYPE), axis=0)
            acc1 += tl.sum(round_to(v1 * g1, DTYPE), axis=0)
        # RMS norm of the pooled entry (pairs past HD // 2 are padding: zeros)
        x0, x1 = round_to(acc0, DTYPE), round_to(acc1, DTYPE)
        inv = tl.rsqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / HD + eps)
        live = p < HD // 2
        y0 = round_to(tl.load(w_ptr + 2 * p, mask=live, other=0.0) * (x0 * inv), DTYPE)
        y1 = round_to(tl.load(w_ptr + 2 * p + 1, mask=live, other=0.0) * (x1 * inv), DTYPE)
        # RoPE at the window's first position on the trailing HALF pairs
        k = p - (HD // 2 - HALF)
        rope = live & (k >= 0)
        angle = (window * RATE).to(tl.float32) * tl.load(inv_freq_ptr + k, mask=rope, other=0.0)
        c, s = cos_sin(angle, PRECISE)
        r0, r1 = rotate(y0, y1, round_to(c, DTYPE), round_to(s, DTYPE))
        y0, y1 = tl.where(rope, r0, y0), tl.where(rope, r1, y1)
        page = tl.load(table_ptr + b * table_stride + window // page_size).to(tl.int64)
        slot = page * page_size + window % page_size
        if STAGE:
            tl.store(slot_ptr + b, slot)
            dst = out_ptr + b * HD + 2 * p
        else:
            dst = out_ptr + slot * HD + 2 * p
        tl.store(dst, y0.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(dst + 1, y1.to(out_ptr.dtype.element_ty), mask=live)


def compress_decode(
    rows: CompressorRows,
    target: torch.Tensor | None,
    staged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton path of kernels.compress_decode (semantics there); windows that stay open write
    nothing to `target`. staged = (entries [D, head_dim], slots [D] int64), target None: each
    row's entry goes to entries[b] and its slot to slots[b] (-1 where the window stays open,
    that row of entries untouched), for a caller that writes an FP8 pool."""
    kv, gate, positions, slab = rows.kv, rows.gate, rows.positions, rows.slab
    ring_kv, ring_gate, entry_table = rows.ring_kv, rows.ring_gate, rows.entry_table
    n, feats = kv.shape
    rate, head_dim = rows.rate, rows.head_dim
    overlap = feats == 2 * head_dim
    assert overlap or feats == head_dim, (feats, head_dim)
    assert kv.stride(1) == gate.stride(1) == 1 and entry_table.stride(1) == 1
    # The rings are slices of the pool's slab rows: each sequence's [ROWS, F] is dense, the
    # sequences are a slab row apart.
    for ring in (ring_kv, ring_gate):
        assert ring.stride(2) == 1 and ring.stride(1) == feats, (ring.shape, ring.stride())
    if staged is not None:
        out, slots = staged
        assert out.shape == (n, head_dim) and slots.shape == (n,) and slots.dtype == torch.int64
    else:
        assert target is not None, "a target pool, or staged outputs"
        out, slots = target, positions  # (slots unused)
    assert out.is_contiguous()
    if n == 0:
        return
    window_slots = 2 * rate if overlap else rate
    block_p = halves(head_dim)
    block_w = min(triton.next_power_of_2(window_slots), max(1, 2048 // block_p))
    _compress_decode_kernel[(n,)](
        kv, gate, positions, slab, ring_kv, ring_gate, rows.ape.float().contiguous(),
        rows.norm_weight.float().contiguous(), rows.inv_freq.float().contiguous(), entry_table, out,
        slots,
        kv.stride(0), gate.stride(0), ring_kv.stride(0), ring_gate.stride(0), entry_table.stride(0),
        rows.page_size, rows.eps,
        RATE=rate, ROWS=ring_kv.shape[1], F=feats, HD=head_dim, HALF=rows.inv_freq.shape[0],
        OVERLAP=overlap, BLOCK_F=triton.next_power_of_2(feats), BLOCK_W=block_w, BLOCK_P=block_p,
        PRECISE=not INTERPRET, STAGE=staged is not None,
        num_warps=8 if window_slots * block_p > 4096 else 4,
    )  # fmt: skip
