"""Exact top-k selection inside one Triton program, by radix select over fp32 keys.

Scores are mapped to uint32 keys whose unsigned order is the float order, then four passes of
8-bit histograms find the k-th largest key T (each pass counts only the keys that match the
digits fixed so far). The winners are every key > T plus enough keys == T to make k; a last pass
compacts them. Five passes over the candidates, no sort, no buffer beyond the candidates.

Candidates live in global memory as segments (one per producer program): segment s holds
``counts[s]`` keys at ``keys + s * seg_stride`` and their positions at ``pos + s * seg_stride``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def float_to_key(x):
    """fp32 -> uint32 with the same order: flip all bits of negatives, set the sign bit else."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def radix_threshold(keys, counts, num_segs, seg_stride, k, BLOCK: tl.constexpr):
    """The k-th largest key T and how many keys equal to T belong to the top k.

    Needs at least k candidates in total. Returns (T: uint32, take_equal: int32)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)  # digits of T fixed so far
    need = k  # winners still to find among keys that match prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constexpr, like p
        hist = tl.zeros([256], tl.int32)
        for seg in range(num_segs):
            count = tl.load(counts + seg)
            for start in range(0, count, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < count
                key = tl.load(keys + seg * seg_stride + offs, mask=mask, other=0)
                key = key.to(tl.uint32, bitcast=True)
                if shift < 24:
                    mask = mask & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=mask)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matches with digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
    return prefix, need


@triton.jit
def compact_top(
    keys, pos, counts, num_segs, seg_stride, threshold, take_equal, out_keys, out_pos,
    WRITE_KEYS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Write the winners' positions (and keys if WRITE_KEYS) densely from out_pos[0].

    Winners: keys > threshold, then the first take_equal keys == threshold in candidate order.
    Safe in place (out = the single segment): an entry is only ever moved to a lower index."""
    written = 0
    equal_seen = 0
    for seg in range(num_segs):
        count = tl.load(counts + seg)
        for start in range(0, count, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < count
            key = tl.load(keys + seg * seg_stride + offs, mask=mask, other=0)
            key = key.to(tl.uint32, bitcast=True)
            p = tl.load(pos + seg * seg_stride + offs, mask=mask, other=-1)
            above = (mask & (key > threshold)).to(tl.int32)
            equal = (mask & (key == threshold)).to(tl.int32)
            equal_rank = equal_seen + tl.cumsum(equal, 0) - equal
            take = above | (equal & (equal_rank < take_equal).to(tl.int32))
            dst = written + tl.cumsum(take, 0) - take
            tl.debug_barrier()  # in place: every lane has read its entry before any overwrite
            tl.store(out_pos + dst, p, mask=take != 0)
            if WRITE_KEYS:
                tl.store(out_keys + dst, key.to(tl.int32, bitcast=True), mask=take != 0)
            written += tl.sum(take, 0)
            equal_seen += tl.sum(equal, 0)
    return written
