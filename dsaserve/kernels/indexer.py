"""Lightning-indexer top-k over paged keys, capped to each request's real context (Triton).

Entry j of request b is ``k_cache[page_table[b, j // P], j % P]``, its score
``scale * sum_h weights[b, h] * relu(q[b, h] . k_j)``. Rows with lengths[b] <= topk return
0..len-1 (padded with -1) without scoring.

Two kernels, grid fixed by (B, splits) and never by the page table's width:
1. ``_score_kernel`` (B, splits): each program takes an equal contiguous share of the row's
   first lengths[b] entries, scores it tile by tile on tensor cores ([Hi, Di] x [Di, BLOCK_N])
   and appends the entries that beat its running floor to its own candidate segment. When the
   segment has no room for another tile it keeps its top-k in place (radix select) and raises
   the floor to the k-th score, so later tiles mostly append nothing.
2. ``_merge_kernel`` (B,): radix select of the row's top-k over its splits' candidates.
   With one split the score kernel does this itself and the merge is not launched. With
   ``merge_group`` G, ``_group_merge_kernel`` (B, S / G) first keeps the top-k of each G splits.

How it scales, for B rows, topk = k, splits = S, cap = k + max(room, BLOCK_N):
- work: sum_b lengths[b] x Hi x Di x 2 FLOP and as many key reads, plus a few passes over at most
  S x cap candidates per row; nothing for entries past lengths[b] or rows with lengths[b] <= k.
- memory: candidates B x S x cap x 8 bytes (int32 key + position) and B x S counts, plus the
  [B, k] output; independent of the configured maximum context (page_table's width) and of the
  pool size. S depends on shapes only, so a decode graph keeps it: ``shape_config`` on B alone
  (about two programs per SM, at most 16); ``context_config`` (``default_config``'s base) also
  lets S grow with the page table's width when B is small, cuts each split to its top-k before
  the merge (``final_cut``) and merges in two levels; then the merge reads S x k candidates a
  row, and the group results add B x S / G x k x 8 bytes.
No host synchronisation: the call can be captured in a CUDA graph.

Registers bound the score loop's occupancy (ptxas for sm_90, Triton 3.9, at the bench's shapes:
136 a thread at 8 warps for shape_config's loop, so one program per SM; 172 with fp8_dot's hand
prefetch). ``max_regs`` = 128 lets two 8-warp programs share an SM; the pipelined runs
(``stages``) hold the next tiles in shared memory instead of registers and fit that cap.

Keys come from a plain cache [pages, P, Di] or an FP8 pool (uint8 pages, kernels.kv_quant): the
score loop reads either through ``_load_keys``, a constexpr switch; FP8 keys enter the dot as
their e4m3 codes and each entry's score is multiplied by its power-of-two scale afterwards
(exact: relu(s * x) = s * relu(x) for s > 0, and scaling by 2^e commutes with fp32 rounding).

``IndexerConfig.fp8_dot`` (FP8 pools only) also quantizes the queries and runs an FP8 MMA, as the
release does: DeepSeek-V3.2's Indexer.forward quantizes q with ``act_quant(q, 128, "ue8m0")``
(one power-of-two scale per query row and head over its 128 values, codes e4m3 rounded to
nearest even), folds that scale into the head weights (``weights * q_scale``) and scores the e4m3
codes of q and k (``fp8_index``; DeepGEMM's fp8_paged_mqa_logits takes the same e4m3 q). Here each
program quantizes its row's q with the same rounding (kernels.act_quant.quantize_rows) and
multiplies w by the scale; q_codes . k_codes runs on the tensor cores' FP8 path into fp32
accumulators (Triton's sm_90 default for FP8 dots: the tensor cores' own accumulation, no
promotion inside the 128-deep dot). What changes: q is rounded to e4m3, so each q value moves by
at most 2^-4 of itself (half an ulp of 3 mantissa bits; 2^-10 of the scale below e4m3's normal
range) and scores move accordingly, a few percent of a row's largest score at random data:
entries near the top-k boundary may trade places (tests/kernels/test_indexer.py bounds it). The
keys and their scales are as before (the pool is e4m3 already). Why that is acceptable: it is
V3.2's official scoring, and V4's release rounds its indexer's q and k more coarsely still (an
FP4 round trip, 32-value blocks, that the model was trained with); the change is a loss against
a bf16 reference only. Under the interpreter the codes' values enter an fp32 dot (exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import quantize_rows
from dsaserve.kernels.env import INTERPRET, dot_precision, num_sms
from dsaserve.kernels.kv_quant import index_page_size, keys_per_page, load_index_k_fp8
from dsaserve.kernels.radix_select import compact_top, float_to_key, radix_threshold


@dataclass(frozen=True)
class IndexerConfig:
    block_n: int  # entries scored per step
    num_splits: int  # programs per row
    room: int  # candidates a split may append between two top-k cuts
    select_block: int  # candidates per step of the radix select
    num_warps: int
    num_stages: int
    # Load the next tile's keys (and the page ids of the one after) before scoring this one.
    # The score loop is not software-pipelined (the in-loop top-k cut holds loops), so without
    # this every tile waits for two dependent loads, page id then keys, at long contexts.
    prefetch: bool = True
    # FP8 pools only: queries quantized to e4m3 in the kernel and an FP8 MMA (module docstring).
    fp8_dot: bool = False
    # Keys on the MMA's M side: the per-key head sum stays inside a warp (_tile_scores).
    key_rows: bool = False
    # > 0: runs of tiles between two cuts software-pipelined this many stages deep (tl.range)
    # instead of the hand prefetch; a run ends where the room left could fill.
    stages: int = 0
    # Each split cuts its candidates to its top-k before the merge, which then reads at most
    # splits x topk entries a row instead of up to splits x cap: splits work in parallel, a
    # row's merge in one program.
    final_cut: bool = False
    # > 0: the merge runs in two levels, programs of merge_group splits first (each keeps its
    # splits' top-k), then one program a row over their results: many splits (long context, small
    # B) no longer funnel all their candidates through one program.
    merge_group: int = 0
    # > 0: cap the score kernel's registers per thread (ptxas -maxnreg); 128 at 8 warps lets two
    # programs share an SM.
    max_regs: int = 0


def shape_config(batch: int, device: torch.device) -> IndexerConfig:
    """Batch-only choice (the default before 2026-12-04, kept as context_config's base and the
    bench's baseline): about two programs per SM, at most 16 splits per row; room for 2048
    candidates per split unless the batch is large (prefill rows), to bound the scratch."""
    num_splits = max(1, min(triton.cdiv(2 * num_sms(device), batch), 16))
    room = 2048 if batch * num_splits <= 4096 else 512
    return IndexerConfig(128, num_splits, room, 1024, 8, 1)


def default_config(batch: int, max_entries: int, device: torch.device) -> IndexerConfig:
    """The fastest exact config the H200 measured (bench/results/h200-indexer-fp8.json, both
    key formats, 256K and 1M tokens): keys on the MMA's M side and splits from the context;
    one program per SM for a lone row (1.7-3.0x shape_config at B=1), two per SM under the
    register cap with pipelined runs from B=8 (1.4-2.6x at B=8 and 32). Between 1 and 8 rows
    nothing was measured: below 8 takes the lone row's. max_entries: the page table's width x
    the page size (shapes only, so a CUDA graph keeps the choice)."""
    if batch < 8:
        return replace(context_config(batch, max_entries, device), key_rows=True)
    cfg = context_config(batch, max_entries, device, programs_per_sm=2)
    return replace(cfg, key_rows=True, stages=3)


def context_splits(
    batch: int,
    max_entries: int,
    device: torch.device,
    *,
    programs_per_sm: int = 1,
    min_tiles: int = 8,
    block_n: int = 128,
) -> int:
    """Splits per row from shapes only, so a CUDA graph keeps them: enough to give every SM
    programs_per_sm programs over the batch (at most one wave: B x S <= programs_per_sm x SMs),
    but at least min_tiles tiles of max_entries (page table width x page size: a row's longest
    possible context) per split. Unlike shape_config's, it grows with the context when B is
    small."""
    fill = max(1, programs_per_sm * num_sms(device) // batch)
    return max(1, min(fill, max_entries // (min_tiles * block_n)))


def context_config(
    batch: int, max_entries: int, device: torch.device, *, programs_per_sm: int = 1
) -> IndexerConfig:
    """shape_config with context_splits, each split cut to its top-k, and the merge in two
    levels of about sqrt(splits) segments each; two programs per SM get the 128-register cap that
    lets them share one (8 warps). Shapes only, as shape_config."""
    base = shape_config(batch, device)
    splits = context_splits(
        batch, max_entries, device, programs_per_sm=programs_per_sm, block_n=base.block_n
    )
    return replace(
        base,
        num_splits=splits,
        final_cut=True,
        merge_group=max(2, math.isqrt(splits)),
        max_regs=128 if programs_per_sm > 1 else 0,
    )


@triton.jit
def _emit_row(keys, pos, counts, n, idx_row, topk, cap, num_splits, SELECT_BLOCK: tl.constexpr):
    """Write row's output: 0..n-1 and -1 padding when n <= topk, else the top-k positions."""
    if n > topk:
        threshold, take_equal = radix_threshold(keys, counts, num_splits, cap, topk, SELECT_BLOCK)
        compact_top(
            keys,
            pos,
            counts,
            num_splits,
            cap,
            threshold,
            take_equal,
            keys,
            idx_row,
            False,
            SELECT_BLOCK,
        )
    else:
        for start in range(0, topk, SELECT_BLOCK):
            offs = start + tl.arange(0, SELECT_BLOCK)
            tl.store(idx_row + offs, tl.where(offs < n, offs, -1), mask=offs < topk)


@triton.jit
def _load_keys(
    kc_ptr, page, off, valid, stride_kp, stride_ks, page_size, dims, KEYS_FP8: tl.constexpr,
    FP8_DOT: tl.constexpr,
):  # fmt: skip
    """Keys at (page, offset) [BLOCK_N], 0 where not valid, and their per-token scales: a plain
    cache [pages, P, Di] gives its own dtype (scales unused), an FP8 pool (kernels.kv_quant layout,
    page stride stride_kp) gives its e4m3 codes (as fp8 for an FP8 MMA, else fp32) and fp32
    scales."""
    if KEYS_FP8:
        return load_index_k_fp8(
            kc_ptr, page, off, valid, stride_kp, page_size, dims.shape[0],
            tl.float8e4nv if FP8_DOT else tl.float32,
        )  # fmt: skip
    else:
        rows = kc_ptr + page.to(tl.int64) * stride_kp + off * stride_ks
        # a row-only mask keeps the key loads 16 bytes wide
        k = tl.load(rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        return k, tl.full(valid.shape, 1.0, tl.float32)


@triton.jit
def _tile_scores(
    q, w, k, k_scale, scale, KEYS_FP8: tl.constexpr, KEY_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Scores [BLOCK_N] of one key tile k [BLOCK_N, Di] for queries q [Hi, Di], weights w [Hi].
    KEY_ROWS puts the keys on the MMA's M side ([BLOCK_N, Hi] logits): each key's head sum then
    stays inside a warp instead of crossing warps through shared memory."""
    if KEY_ROWS:
        logits = tl.dot(k.to(q.dtype), tl.trans(q), input_precision=DOT_PRECISION)
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1) * scale
    else:
        logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0) * scale
    if KEYS_FP8:  # a power-of-two key scale commutes with the dot, ReLU and head sum
        score = score * k_scale
    return score


@triton.jit
def _append(keys, pos, score, j, valid, floor, count):
    """Append the entries j whose scores beat floor to the segment (keys, pos) after its first
    count entries; returns the new count."""
    key = float_to_key(score)
    keep = (valid & (key > floor)).to(tl.int32)
    dst = count + tl.cumsum(keep, 0) - keep
    tl.store(keys + dst, key.to(tl.int32, bitcast=True), mask=keep != 0)
    tl.store(pos + dst, j, mask=keep != 0)
    return count + tl.sum(keep, 0)


@triton.jit
def _cut(keys, pos, count_ptr, count, topk, cap, SELECT_BLOCK: tl.constexpr):
    """Keep the segment's top-k in place (count > topk entries); returns the k-th key, below
    which no later entry can enter the segment's top-k."""
    tl.store(count_ptr, count)
    tl.debug_barrier()
    floor, take_equal = radix_threshold(keys, count_ptr, 1, cap, topk, SELECT_BLOCK)
    compact_top(keys, pos, count_ptr, 1, cap, floor, take_equal, keys, pos, True, SELECT_BLOCK)
    tl.debug_barrier()
    return floor


@triton.jit
def _score_kernel(
    q_ptr, w_ptr, kc_ptr, pt_ptr, len_ptr, key_ptr, pos_ptr, cnt_ptr, idx_ptr,
    stride_qb, stride_qh, stride_wb, stride_kp, stride_ks, stride_pt, stride_ib,
    n_heads, page_size, topk, cap, scale, num_splits,
    BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
    EMIT: tl.constexpr, SELECT_BLOCK: tl.constexpr,
    KEYS_FP8: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_DOT: tl.constexpr, KEY_ROWS: tl.constexpr,
    STAGES: tl.constexpr, FINAL_CUT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n = tl.load(len_ptr + b)
    row_keys = key_ptr + b * num_splits * cap  # this row's candidate segments
    row_pos = pos_ptr + b * num_splits * cap
    row_cnt = cnt_ptr + b * num_splits
    if n > topk:
        keys, pos, count_ptr = row_keys + split * cap, row_pos + split * cap, row_cnt + split
        heads = tl.arange(0, BLOCK_HI)
        dims = tl.arange(0, BLOCK_DI)
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=(heads < n_heads)[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + b * stride_wb + heads, mask=heads < n_heads, other=0.0)  # [BLOCK_HI]
        if FP8_DOT:  # the release's act_quant of each head's row; its scale joins the weight
            q, _, q_scale, _ = quantize_rows(q.to(tl.float32), UPCAST)  # fp32 values if UPCAST
            w = w * q_scale
        elif UPCAST:
            q = q.to(tl.float32)
        # this split's share of the row: a contiguous range of whole tiles
        per_split = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, n)
        count = 0
        floor = tl.zeros([], tl.uint32)  # keys <= floor cannot enter this split's top-k
        pt_row = pt_ptr + b * stride_pt
        if STAGES > 0:
            # Software-pipelined runs of tiles, STAGES deep (page ids, then keys, then the MMA):
            # a run has no cut inside (a loop in a loop is not pipelined), so it is as long as
            # the room left can take if every entry were appended; cut when under half is left.
            min_room = tl.maximum((cap - topk) // (2 * BLOCK_N), 1) * BLOCK_N
            t0 = start
            while t0 < end:
                stop = tl.minimum(end, t0 + (cap - count) // BLOCK_N * BLOCK_N)
                for t in tl.range(t0, stop, BLOCK_N, num_stages=STAGES):
                    j = t + tl.arange(0, BLOCK_N)
                    valid = j < end
                    page = tl.load(pt_row + j // page_size, mask=valid, other=0)
                    k, k_scale = _load_keys(
                        kc_ptr, page, j % page_size, valid, stride_kp, stride_ks, page_size,
                        dims, KEYS_FP8, FP8_DOT,
                    )  # fmt: skip
                    score = _tile_scores(q, w, k, k_scale, scale, KEYS_FP8, KEY_ROWS,
                                         DOT_PRECISION)  # fmt: skip
                    count = _append(keys, pos, score, j, valid, floor, count)
                t0 = stop
                if cap - count < min_room:
                    floor = _cut(keys, pos, count_ptr, count, topk, cap, SELECT_BLOCK)
                    count = topk
        else:
            if PREFETCH:  # the first tile's keys and the second tile's page ids
                j = start + tl.arange(0, BLOCK_N)
                page = tl.load(pt_row + j // page_size, mask=j < end, other=0)
                k_next, scale_next = _load_keys(
                    kc_ptr, page, j % page_size, j < end, stride_kp, stride_ks, page_size, dims,
                    KEYS_FP8, FP8_DOT,
                )  # fmt: skip
                j += BLOCK_N
                page_next = tl.load(pt_row + j // page_size, mask=j < end, other=0)
            for t0 in range(start, end, BLOCK_N):
                j = t0 + tl.arange(0, BLOCK_N)
                valid = j < end
                if PREFETCH:  # this tile's keys arrived during the previous tile; ask for the next
                    k, k_scale = k_next, scale_next
                    j1 = j + BLOCK_N
                    k_next, scale_next = _load_keys(
                        kc_ptr, page_next, j1 % page_size, j1 < end, stride_kp, stride_ks,
                        page_size, dims, KEYS_FP8, FP8_DOT,
                    )  # fmt: skip
                    j2 = j1 + BLOCK_N
                    page_next = tl.load(pt_row + j2 // page_size, mask=j2 < end, other=0)
                else:
                    page = tl.load(pt_row + j // page_size, mask=valid, other=0)
                    k, k_scale = _load_keys(
                        kc_ptr, page, j % page_size, valid, stride_kp, stride_ks, page_size,
                        dims, KEYS_FP8, FP8_DOT,
                    )  # fmt: skip
                score = _tile_scores(q, w, k, k_scale, scale, KEYS_FP8, KEY_ROWS, DOT_PRECISION)
                count = _append(keys, pos, score, j, valid, floor, count)
                if count > cap - BLOCK_N:  # no room for another tile: keep the top-k only
                    floor = _cut(keys, pos, count_ptr, count, topk, cap, SELECT_BLOCK)
                    count = topk
        if FINAL_CUT and count > topk:  # the merge then reads at most topk entries a split
            _cut(keys, pos, count_ptr, count, topk, cap, SELECT_BLOCK)
            count = topk
        tl.store(count_ptr, count)
    if EMIT:  # a single split: this program holds the row's only candidates
        tl.debug_barrier()
        _emit_row(
            row_keys, row_pos, row_cnt, n, idx_ptr + b * stride_ib, topk, cap, 1, SELECT_BLOCK
        )


@triton.jit
def _merge_kernel(
    key_ptr, pos_ptr, cnt_ptr, len_ptr, idx_ptr,
    stride_ib,
    topk, cap, num_splits,
    SELECT_BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    _emit_row(
        key_ptr + b * num_splits * cap,
        pos_ptr + b * num_splits * cap,
        cnt_ptr + b * num_splits,
        tl.load(len_ptr + b),
        idx_ptr + b * stride_ib,
        topk,
        cap,
        num_splits,
        SELECT_BLOCK,
    )


@triton.jit
def _group_merge_kernel(
    key_ptr, pos_ptr, cnt_ptr, len_ptr, out_key_ptr, out_pos_ptr, out_cnt_ptr,
    topk, cap, num_splits, group,
    SELECT_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (b, g): the top-k of splits g * group .. of row b, keys and positions, into
    segment g (stride topk) of the row's group results; fewer than topk candidates are copied."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    groups = tl.num_programs(1)
    if tl.load(len_ptr + b) > topk:
        first = g * group
        segs = tl.minimum(group, num_splits - first)
        keys = key_ptr + (b * num_splits + first) * cap
        pos = pos_ptr + (b * num_splits + first) * cap
        counts = cnt_ptr + b * num_splits + first
        total = 0
        for s in range(segs):
            total += tl.load(counts + s)
        threshold = tl.zeros([], tl.uint32)  # with few candidates: every key >= 0, i.e. all
        take_equal = total
        if total > topk:
            threshold, take_equal = radix_threshold(keys, counts, segs, cap, topk, SELECT_BLOCK)
        out = (b * groups + g) * topk
        written = compact_top(
            keys, pos, counts, segs, cap, threshold, take_equal,
            out_key_ptr + out, out_pos_ptr + out, True, SELECT_BLOCK,
        )  # fmt: skip
        tl.store(out_cnt_ptr + b * groups + g, written)


def check_indexer_args(q, weights, k_cache, page_table, lengths) -> None:
    """Validate shapes and dtypes (no data read)."""
    batch, n_heads, head_dim = q.shape
    assert weights.shape == (batch, n_heads) and weights.dtype == torch.float32
    if k_cache.dtype == torch.uint8:  # FP8 pool [pages, P * (Di + 4)]
        index_page_size(k_cache, head_dim)
        assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), q.dtype
    else:
        assert k_cache.dim() == 3 and k_cache.shape[2] == head_dim and k_cache.dtype == q.dtype
    assert page_table.dim() == 2 and page_table.shape[0] == batch
    assert page_table.dtype == torch.int32 and lengths.dtype == torch.int32
    assert lengths.shape == (batch,)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"Di = {head_dim}: a power of two"


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    scale: float,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Triton indexer top-k; semantics in kernels.dispatch.indexer_topk."""
    check_indexer_args(q, weights, k_cache, page_table, lengths)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    batch, n_heads, head_dim = q.shape
    page_size = keys_per_page(k_cache, head_dim)
    cfg = config or default_config(batch, page_table.shape[1] * page_size, q.device)
    keys_fp8 = k_cache.dtype == torch.uint8
    if cfg.fp8_dot and not keys_fp8:
        raise ValueError("fp8_dot scores FP8 key pools only (uint8 k_cache)")
    cap = topk + max(cfg.room, cfg.block_n)  # the kept top-k + room for at least one tile
    dev = q.device
    keys = torch.empty(batch, cfg.num_splits, cap, dtype=torch.int32, device=dev)
    pos = torch.empty(batch, cfg.num_splits, cap, dtype=torch.int32, device=dev)
    counts = torch.empty(batch, cfg.num_splits, dtype=torch.int32, device=dev)
    idx = torch.empty(batch, topk, dtype=torch.int32, device=dev)  # [B, topk]
    _score_kernel[(batch, cfg.num_splits)](
        q, weights, k_cache, page_table, lengths, keys, pos, counts, idx,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), idx.stride(0),
        n_heads, page_size, topk, cap, scale, cfg.num_splits,
        BLOCK_HI=max(16, triton.next_power_of_2(n_heads)), BLOCK_DI=head_dim, BLOCK_N=cfg.block_n,
        EMIT=cfg.num_splits == 1, SELECT_BLOCK=cfg.select_block, KEYS_FP8=keys_fp8,
        PREFETCH=cfg.prefetch, UPCAST=INTERPRET, DOT_PRECISION=dot_precision(q.dtype),
        FP8_DOT=cfg.fp8_dot, KEY_ROWS=cfg.key_rows, STAGES=cfg.stages, FINAL_CUT=cfg.final_cut,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs or None,
    )  # fmt: skip
    if cfg.num_splits == 1:
        return idx
    segments = cfg.num_splits
    if 0 < cfg.merge_group < cfg.num_splits:
        segments = triton.cdiv(cfg.num_splits, cfg.merge_group)
        group_keys = torch.empty(batch, segments, topk, dtype=torch.int32, device=dev)
        group_pos = torch.empty(batch, segments, topk, dtype=torch.int32, device=dev)
        group_counts = torch.empty(batch, segments, dtype=torch.int32, device=dev)
        _group_merge_kernel[(batch, segments)](
            keys, pos, counts, lengths, group_keys, group_pos, group_counts,
            topk, cap, cfg.num_splits, cfg.merge_group,
            SELECT_BLOCK=cfg.select_block,
            num_warps=cfg.num_warps,
        )  # fmt: skip
        keys, pos, counts, cap = group_keys, group_pos, group_counts, topk
    _merge_kernel[(batch,)](
        keys, pos, counts, lengths, idx,
        idx.stride(0),
        topk, cap, segments,
        SELECT_BLOCK=cfg.select_block,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return idx
