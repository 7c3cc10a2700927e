"""Long-context and FP8-KV phases of bench.kernels: the sparse-MLA decode and the indexer at 256K
and 1M tokens of context over bf16 and FP8 pools, each against its byte floor; the pools'
capacity in tokens per GiB; quantize-on-write against index_copy_.

    python -m bench.kernels --only capacity store long-decode --out bench/results/h200-kv-fp8.json
    python -m bench.kernels --only long-indexer --out bench/results/h200-kv-fp8.json
    python -m bench.kernels --only capacity store long-decode long-indexer --smoke   # CPU

Phases (several in one command run one process each, so a CUDA fault stays in its phase; a
phase that fails records its traceback under "errors" in the JSON, and a measurement that fails
records its own error and the phase goes on):
- ``capacity``: bytes per slot of the real pool tensors (bf16 [S, 512] / [S, 128] against
  kernels.kv_quant's FP8 pages) and tokens of context per GiB for V4-Flash's layer mix.
- ``store``: writing N rows into 1M-slot pools: kernels.store_kv_fp8 / store_index_k_fp8 against
  the bf16 pools' index_copy_, N = 64 (a decode step) and 8192 (a prefill chunk).
- ``long-decode``: per context, batch and layer kind, one decode call of 64 heads over
  window (128) + 512 picked entries (CSA) or window + every HCA entry (context / 128), bf16
  and FP8 pools; then tile configs at 1M.
- ``long-indexer``: indexer top-512 over context / 4 entries per row (64 heads x 128), bf16 and
  FP8 keys; per shape the score-loop variants beside the default (``indexer_variants``: splits
  from the context, pipelined runs, FP8 queries and MMA), each checked against the reference
  (score gap, top-k overlap) before it is timed; then splits x prefetch at 1M, B = 8.

Byte floor = bytes a call must read and write (gathered rows or scored keys, page ids, q, output)
/ the copy bandwidth measured in the same process (bytes read + written per second of a 4 GiB
device-to-device copy). Correctness first: each timed kernel (its exact config) is checked
against the float64 / fp32 reference on a subset of its rows; the FP8 reference reads the pool's
exact dequantization.

Pools: one attention pool per shape, shared by the batch rows, with max(B x entries per request,
1M) slots (at most 8M, i.e. 8 GiB bf16: 1M / B=32 / CSA needs exactly that) and random slot ids
per row; one key pool with SETS x B x entries keys (at most 32M, 8 GiB bf16), each row of each
input set owning random distinct pages. Times are medians of CUDA-graph replays, each replay
cycling through SETS input sets; every pool is far beyond the 50 MB L2.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable

import torch
import triton

from bench.compare import rel_err_or_nan
from bench.harness import (
    Env,
    attempt,
    ceilings,
    kernel_breakdown,
    prologue,
    read_record,
    timed,
    write_record,
)
from dsaserve import kernels
from dsaserve.kernels import indexer, kv_quant, reference, sparse_mla
from dsaserve.kernels.indexer import IndexerConfig
from dsaserve.kernels.sparse_mla import DecodeConfig


@dataclasses.dataclass(frozen=True)
class Sizes:
    contexts: tuple[int, ...]  # tokens of context per request
    batches: tuple[int, ...]
    heads: int  # attention query heads
    window: int  # sliding-window rows a query attends
    csa_topk: int  # compressed entries the indexer picks
    csa_ratio: int  # tokens per CSA entry
    hca_ratio: int  # tokens per HCA entry
    idx_heads: int
    idx_dim: int
    idx_topk: int
    page: int
    sets: int  # rotating input sets per timed unit
    min_pool_slots: int
    max_pool_slots: int
    max_key_entries: int
    store_rows: tuple[int, ...]
    store_slots: int
    alternatives: int  # configs tried beside the default


# V4-Flash (HF configuration_deepseek_v4 defaults: window 128, index_topk 512, 64 heads,
# index 64 x 128, compress rates 4 / 128), page 64 as the engine's KVCacheConfig
H200 = Sizes(
    (1 << 18, 1 << 20), (1, 8, 32), 64, 128, 512, 4, 128, 64, 128, 512, 64, 4,
    1 << 20, 1 << 23, 1 << 25, (64, 8192), 1 << 20, 4,
)  # fmt: skip
SMOKE = Sizes(
    (2048, 8192), (1, 2), 16, 8, 16, 4, 128, 16, 32, 16, 16, 2,
    1 << 10, 1 << 12, 1 << 13, (8, 40), 1 << 10, 2,
)  # fmt: skip
# V4-Flash's layers by kind: 2 sliding-window, then CSA / HCA alternating over the other 41
# (compress_ratios [0, 0, 4, 128, 4, ...], as quoted in a third-party config; the ratio below
# barely moves with the mix). Sliding layers hold a fixed ring per request, no per-token bytes.
V4_FLASH_LAYERS = {"csa": 21, "hca": 20}
KV_DIM = kv_quant.KV_DIM
SM_SCALE = KV_DIM**-0.5
CHUNK = 1 << 20  # rows quantized per store call while filling a pool


# ---- helpers -------------------------------------------------------------------------------


def free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rounded(n: int, multiple: int) -> int:
    return triton.cdiv(n, multiple) * multiple


def attention_pools(env: Env, slots: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 pool [slots, 512] of random rows and its FP8 twin (the same rows, quantized)."""
    bf16 = torch.randn(slots, KV_DIM, device=env.device, dtype=torch.bfloat16)
    fp8 = kv_quant.kv_pool(slots // page, page, env.device)
    for s in range(0, slots, CHUNK):
        ids = torch.arange(s, min(s + CHUNK, slots), device=env.device)
        kernels.store_kv_fp8(fp8, ids, bf16[s : s + CHUNK])
    return bf16, fp8


def key_pools(env: Env, sz: Sizes, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 keys [pages, P, Di] (random) and their FP8 twin [pages, P * (Di + 4)]."""
    pages = entries // sz.page
    bf16 = torch.randn(pages, sz.page, sz.idx_dim, device=env.device, dtype=torch.bfloat16)
    fp8 = kv_quant.index_pool(pages, sz.page, sz.idx_dim, env.device)
    flat = bf16.view(-1, sz.idx_dim)
    for s in range(0, flat.shape[0], CHUNK):
        ids = torch.arange(s, min(s + CHUNK, flat.shape[0]), device=env.device)
        kernels.store_index_k_fp8(fp8, ids, flat[s : s + CHUNK])
    return bf16, fp8


def breakdown(env: Env, fn: Callable, args: tuple) -> dict[str, float]:
    """us per call of each CUDA kernel fn launches; {} in --smoke."""
    return {} if env.smoke else kernel_breakdown(fn, args)


# ---- capacity ------------------------------------------------------------------------------


def phase_capacity(env: Env, sz: Sizes, result: dict, hw: dict, save: Callable) -> None:
    pages, p, dev = 16, sz.page, env.device
    pools = {
        "bf16": (
            torch.empty(pages * p, KV_DIM, dtype=torch.bfloat16, device=dev),
            torch.empty(pages, p, 128, dtype=torch.bfloat16, device=dev),
        ),
        "fp8": (kv_quant.kv_pool(pages, p, dev), kv_quant.index_pool(pages, p, 128, dev)),
    }
    rows = {}
    for fmt, (kv, keys) in pools.items():
        kv_b, key_b = (t.numel() * t.element_size() / (pages * p) for t in (kv, keys))
        per_token = {  # pool bytes per token of context, per layer of each kind
            "csa": (kv_b + key_b) / 4,
            "hca": kv_b / 128,
        }
        model = sum(n * per_token[kind] for kind, n in V4_FLASH_LAYERS.items())
        rows[fmt] = {
            "kv_bytes_per_entry": kv_b,
            "index_key_bytes_per_entry": key_b,
            "bytes_per_token": {**per_token, "v4_flash": model},
            "tokens_per_GiB": {k: 2**30 / v for k, v in {**per_token, "v4_flash": model}.items()},
        }
    ratio = {k: rows["bf16"]["bytes_per_token"][k] / rows["fp8"]["bytes_per_token"][k] for k in
             ("csa", "hca", "v4_flash")}  # fmt: skip
    ratio["attention_entries_only"] = (
        rows["bf16"]["kv_bytes_per_entry"] / rows["fp8"]["kv_bytes_per_entry"]
    )
    rows["fp8_over_bf16_tokens_per_GiB"] = ratio
    result["capacity"] = rows
    print(
        f"capacity: {rows['bf16']['kv_bytes_per_entry']:.0f} -> "
        f"{rows['fp8']['kv_bytes_per_entry']:.0f} B per attention entry, "
        f"{rows['bf16']['index_key_bytes_per_entry']:.0f} -> "
        f"{rows['fp8']['index_key_bytes_per_entry']:.0f} B per index key; tokens per GiB x"
        f"{ratio['v4_flash']:.3f} (V4-Flash mix), x{ratio['csa']:.3f} CSA, x{ratio['hca']:.3f} HCA"
        f" (target >= 1.8)",
        flush=True,
    )


# ---- store ---------------------------------------------------------------------------------


def store_row(env: Env, hw: dict, label: str, fn: Callable, sets: list, bytes_moved: int) -> dict:
    ms, mode = timed(env, fn, sets)
    floor_us = bytes_moved / hw["copy_GBps"] / 1e3
    row = {"what": label, "us": 1e3 * ms, "floor_us": floor_us, "x_floor": 1e3 * ms / floor_us}
    row["mode"] = mode
    print(f"  {label:<34} {row['us']:8.1f} us  floor {floor_us:7.2f} us  x{row['x_floor']:.1f}")
    return row


def phase_store(env: Env, sz: Sizes, result: dict, hw: dict, save: Callable) -> None:
    dev, s_slots, p = env.device, sz.store_slots, sz.page
    kv_bf16 = torch.zeros(s_slots, KV_DIM, dtype=torch.bfloat16, device=dev)
    keys_bf16 = torch.zeros(s_slots, 128, dtype=torch.bfloat16, device=dev)
    kv_fp8 = kv_quant.kv_pool(s_slots // p, p, dev)
    keys_fp8 = kv_quant.index_pool(s_slots // p, p, 128, dev)
    rows = []
    for n in sz.store_rows:
        print(f"store, {n} rows into {s_slots} slots:")
        sets = [
            (
                torch.randn(n, KV_DIM, device=dev).to(torch.bfloat16),
                torch.randn(n, 128, device=dev).to(torch.bfloat16),
                torch.randperm(s_slots, device=dev)[:n],
            )
            for _ in range(sz.sets)
        ]
        kv, keys, slots = sets[0]
        want = kv_quant.kv_pool(s_slots // p, p, dev)
        kv_quant.store_kv_reference(want, slots, kv)
        kv_quant.store_kv(kv_fp8.zero_(), slots, kv)
        want_k = kv_quant.index_pool(s_slots // p, p, 128, dev)
        kv_quant.store_index_k_reference(want_k, slots, keys)
        kv_quant.store_index_k(keys_fp8.zero_(), slots, keys)
        same = bool(torch.equal(want, kv_fp8)) and bool(torch.equal(want_k, keys_fp8))
        del want, want_k
        print(f"  Triton bytes == reference bytes: {same}")
        cases = [
            ("bf16 kv index_copy_", lambda x, k, s: kv_bf16.index_copy_(0, s, x), 2 * 1024),
            ("fp8 kv store_kv_fp8", lambda x, k, s: kv_quant.store_kv(kv_fp8, s, x), 1024 + 584),
            ("bf16 key index_copy_", lambda x, k, s: keys_bf16.index_copy_(0, s, k), 2 * 256),
            ("fp8 key store_index_k_fp8", lambda x, k, s: kv_quant.store_index_k(keys_fp8, s, k),
             256 + 132),
        ]  # fmt: skip
        for label, fn, row_bytes in cases:
            r = attempt(label, store_row, env, hw, label, fn, sets, n * (row_bytes + 8))
            rows.append({"rows": n, "bytes_equal_reference": same, **r})
        result["store"] = rows
        save()


# ---- long-context decode -------------------------------------------------------------------


def decode_run(pool: torch.Tensor, cfg: DecodeConfig) -> Callable:
    def run(q, idx, lengths, sinks):
        return sparse_mla.sparse_mla_decode(
            q, pool, idx, SM_SCALE, sinks=sinks, lengths=lengths, config=cfg
        )

    return run


def decode_error(run: Callable, pool: torch.Tensor, q, idx, lengths, sinks) -> float:
    """Relative error of out against float64 on <= 4 rows of the timed inputs, with holes and
    ragged lengths; the reference reads the same pool (FP8: its exact dequantization)."""
    rows = min(4, q.shape[0])
    q, idx = q[:rows], idx[:rows].clone()
    idx[torch.rand(idx.shape, device=idx.device) < 0.1] = -1
    lengths = torch.randint(1, idx.shape[1] + 1, (rows,), device=idx.device, dtype=torch.int32)
    out, _ = run(q, idx, lengths, sinks)
    ref, _ = reference.sparse_mla_decode(
        q.double(), pool, idx, SM_SCALE, sinks=sinks, lengths=lengths
    )
    return rel_err_or_nan(out, ref)


def time_decode(
    env: Env, hw: dict, shape: dict, fmt: str, pool: torch.Tensor, cfg: DecodeConfig, sets: list
) -> dict:
    run = decode_run(pool, cfg)
    err = decode_error(run, pool, *sets[0])
    ms, mode = timed(env, run, sets)
    b, k = shape["B"], shape["K"]
    row_bytes = KV_DIM * 2 if fmt == "bf16" else kv_quant.KV_TOKEN_BYTES
    moved = b * k * (row_bytes + 4) + 2 * b * shape["H"] * KV_DIM * 2  # rows + ids, q + out
    floor_us = moved / hw["copy_GBps"] / 1e3
    row = {**shape, "format": fmt, "config": dataclasses.asdict(cfg), "rel_err": err}
    row.update(us=1e3 * ms, floor_us=floor_us, x_floor=1e3 * ms / floor_us, mode=mode)
    row["GBps"] = moved / (1e3 * ms) / 1e3
    return row


def print_decode(r: dict) -> None:
    if "error" in r:
        return
    c = r["config"]
    cfg = (
        f"h{c['block_h']} n{c['block_n']} s{c['num_splits']} w{c['num_warps']} st{c['num_stages']}"
    )
    extra = f"  x{r['x_bf16']:.2f} bf16" if "x_bf16" in r else ""
    print(
        f"  {r['kind']} ctx={r['ctx'] >> 10}K B={r['B']:<3} K={r['K']:<5} {r['format']:<4}"
        f" {cfg:<22}"
        f" err {r['rel_err']:.1e} {r['us']:8.1f} us  floor {r['floor_us']:7.2f} us"
        f"  x{r['x_floor']:.2f} floor{extra}",
        flush=True,
    )


def decode_sets(env: Env, sz: Sizes, batch: int, num_idx: int, slots: int) -> list[tuple]:
    dev = env.device
    return [
        (
            torch.randn(batch, sz.heads, KV_DIM, device=dev).to(torch.bfloat16),
            torch.randint(0, slots, (batch, num_idx), device=dev, dtype=torch.int32),
            torch.full((batch,), num_idx, device=dev, dtype=torch.int32),
            torch.randn(sz.heads, device=dev),
        )
        for _ in range(sz.sets)
    ]


def decode_alternatives(sz: Sizes, default: DecodeConfig) -> list[DecodeConfig]:
    tiles = [(32, 8, 3), (16, 8, 4), (32, 8, 2), (64, 8, 2)][: sz.alternatives]
    return [DecodeConfig(default.block_h, n, default.num_splits, w, st) for n, w, st in tiles]


def phase_long_decode(env: Env, sz: Sizes, result: dict, hw: dict, save: Callable) -> None:
    rows, alternatives = [], []
    result["long_decode"], result["long_decode_alternatives"] = rows, alternatives
    for ctx in sz.contexts:
        for kind in ("csa", "hca"):
            ratio = sz.csa_ratio if kind == "csa" else sz.hca_ratio
            num_idx = sz.window + (sz.csa_topk if kind == "csa" else ctx // sz.hca_ratio)
            for b in sz.batches:
                slots = rounded(
                    min(max(b * (ctx // ratio), sz.min_pool_slots), sz.max_pool_slots), sz.page
                )
                shape = {"kind": kind, "ctx": ctx, "B": b, "H": sz.heads, "K": num_idx}
                shape["pool_slots"] = slots
                print(f"decode {shape}", flush=True)
                pools = dict(
                    zip(("bf16", "fp8"), attention_pools(env, slots, sz.page), strict=True)
                )
                sets = decode_sets(env, sz, b, num_idx, slots)
                cfg = sparse_mla.default_config(b, sz.heads, num_idx, env.device)
                timed = {}
                for fmt, pool in pools.items():
                    r = attempt(f"decode {fmt}", time_decode, env, hw, shape, fmt, pool, cfg, sets)
                    timed[fmt] = r if "error" not in r else None
                    rows.append(r if "error" not in r else {**shape, "format": fmt, **r})
                if timed["bf16"] and timed["fp8"]:
                    timed["fp8"]["x_bf16"] = timed["fp8"]["us"] / timed["bf16"]["us"]
                for r in rows[-2:]:
                    print_decode(r)
                if ctx == sz.contexts[-1] and b == sz.batches[-1]:  # tile configs at 1M
                    for alt in decode_alternatives(sz, cfg):
                        for fmt, pool in pools.items():
                            r = attempt("alternative", time_decode, env, hw, shape, fmt, pool,
                                        alt, sets)  # fmt: skip
                            alternatives.append(r)
                            print_decode(r)
                del pools, sets
                free()
                save()
    fp8_rows = [r for r in rows if "x_bf16" in r]
    if fp8_rows:
        worst = max(fp8_rows, key=lambda r: r["x_bf16"])
        result.setdefault("summary", {})["decode_fp8_over_bf16_worst"] = worst["x_bf16"]
        print(
            f"target decode FP8 / bf16 <= 1.1: worst x{worst['x_bf16']:.2f} ({worst['kind']} "
            f"ctx {worst['ctx'] >> 10}K B={worst['B']})"
        )


# ---- long-context indexer ------------------------------------------------------------------


def indexer_sets(env: Env, sz: Sizes, batch: int, entries: int, pool_pages: int) -> list[tuple]:
    """Per set: q, weights, page table (each row its own random distinct pages), lengths."""
    dev, pages = env.device, entries // sz.page
    out = []
    for _ in range(sz.sets):
        table = torch.stack([torch.randperm(pool_pages, device=dev)[:pages] for _ in range(batch)])
        out.append(
            (
                torch.randn(batch, sz.idx_heads, sz.idx_dim, device=dev).to(torch.bfloat16),
                torch.randn(batch, sz.idx_heads, device=dev),
                table.int(),
                torch.full((batch,), entries, device=dev, dtype=torch.int32),
            )
        )
    return out


def indexer_run(sz: Sizes, keys: torch.Tensor, cfg: IndexerConfig) -> Callable:
    def run(q, w, table, lengths):
        return indexer.indexer_topk(
            q, w, keys, table, lengths, sz.idx_topk, scale=sz.idx_dim**-0.5, config=cfg
        )

    return run


def indexer_agreement(
    sz: Sizes, run: Callable, keys: torch.Tensor, q, w, table, lengths
) -> tuple[float, float]:
    """On the first two rows, against fp32 reference scores of the same keys (FP8: their exact
    dequantization, with unrounded queries): the worst relative gap between the picked and the
    true top-k scores, and the share of picks in the true top-k."""
    idx = run(q, w, table, lengths)[:2].long()
    scores = reference.indexer_scores(
        q[:2], w[:2], keys, table[:2], int(lengths[:2].max()), sz.idx_dim**-0.5
    )
    assert bool((idx.sort(1).values.diff(dim=1) > 0).all()), "repeated positions"
    got = scores.gather(1, idx).sort(1).values
    want = scores.topk(sz.idx_topk, dim=1)
    err = (got - want.values.sort(1).values).abs().max() / want.values.abs().max()
    hits = (idx[:, :, None] == want.indices[:, None, :]).any(-1)  # [2, k]
    return err.item(), hits.float().mean().item()


def time_indexer(
    env: Env,
    sz: Sizes,
    hw: dict,
    shape: dict,
    fmt: str,
    keys: torch.Tensor,
    cfg: IndexerConfig,
    sets: list,
) -> dict:
    run = indexer_run(sz, keys, cfg)
    err, overlap = indexer_agreement(sz, run, keys, *sets[0])
    ms, mode = timed(env, run, sets)
    b, n = shape["B"], shape["entries"]
    key_bytes = 2 * sz.idx_dim if fmt == "bf16" else kv_quant.index_token_bytes(sz.idx_dim)
    q_w = b * sz.idx_heads * (2 * sz.idx_dim + 4)
    moved = b * n * key_bytes + 4 * b * (n // sz.page) + q_w + 4 * b * sz.idx_topk
    floor_us = moved / hw["copy_GBps"] / 1e3
    row = {**shape, "format": fmt, "config": dataclasses.asdict(cfg), "score_rel_err": err}
    row["topk_overlap"] = overlap
    row.update(us=1e3 * ms, floor_us=floor_us, x_floor=1e3 * ms / floor_us, mode=mode)
    row["key_GBps"] = b * n * key_bytes / (1e3 * ms) / 1e3
    return row


def print_indexer(r: dict) -> None:
    if "error" in r:
        return
    c = r["config"]
    cfg = f"s{c['num_splits']} r{c['room']} w{c['num_warps']} pf{int(c['prefetch'])}"
    extra = f"  x{r['x_bf16']:.2f} bf16" if "x_bf16" in r else ""
    if "variant" in r:
        cfg = f"{r['variant']} s{c['num_splits']}"
        extra = f"  {r['x_before']:.2f}x before" if "x_before" in r else ""
    print(
        f"  idx ctx={r['ctx'] >> 10}K B={r['B']:<3} n={r['entries']:<7} {r['format']:<4} {cfg:<28}"
        f" err {r['score_rel_err']:.1e} top-k {100 * r['topk_overlap']:5.1f}% {r['us']:9.1f} us"
        f"  floor {r['floor_us']:8.2f} us  x{r['x_floor']:.2f} floor{extra}",
        flush=True,
    )


def indexer_variants(env: Env, batch: int, entries: int, fmt: str) -> dict[str, IndexerConfig]:
    """The score-loop options timed beside shape_config, the default among them
    (kernels.indexer.IndexerConfig): splits
    from the context (context_config: one program per SM, or two under a 128-register cap),
    pipelined runs (st3), FP8 queries and MMA (fp8dot, FP8 pools only), keys on the MMA's M
    side (kr), 64-entry tiles on 4 warps (n64w4). The bench's page tables are as wide as the
    rows are long, so the context rule sees the real context."""
    ctx1, ctx2 = (
        indexer.context_config(batch, entries, env.device, programs_per_sm=p) for p in (1, 2)
    )
    st3 = dataclasses.replace(ctx2, stages=3)
    variants = {
        "default": indexer.default_config(batch, entries, env.device),
        "ctx": ctx1,
        "ctx2-r128": ctx2,
        "ctx2-st3": st3,
    }
    for name, cfg in list(variants.items())[1:]:  # keys on the M side, q unrounded: exact
        variants[name + "-kr"] = dataclasses.replace(cfg, key_rows=True)
    if fmt == "fp8":
        fp8dot = dataclasses.replace(indexer.shape_config(batch, env.device), fp8_dot=True)
        variants = {"fp8dot": fp8dot, **variants}
        variants["ctx2-st3-fp8dot"] = dataclasses.replace(st3, fp8_dot=True)
        variants["ctx2-st3-fp8dot-kr"] = dataclasses.replace(st3, fp8_dot=True, key_rows=True)
        variants["ctx-fp8dot-kr"] = dataclasses.replace(ctx1, fp8_dot=True, key_rows=True)
        variants["ctx2-r128-fp8dot-kr"] = dataclasses.replace(ctx2, fp8_dot=True, key_rows=True)
        # half the tile, half the warps: four programs an SM under the same register cap
        ctx4 = indexer.context_config(batch, entries, env.device, programs_per_sm=4)
        variants["ctx4-n64w4-st3-fp8dot"] = dataclasses.replace(
            ctx4, block_n=64, num_warps=4, stages=3, fp8_dot=True
        )
    return variants


def phase_long_indexer(env: Env, sz: Sizes, result: dict, hw: dict, save: Callable) -> None:
    rows, alternatives, variants = [], [], []
    result["long_indexer"], result["long_indexer_alternatives"] = rows, alternatives
    result["long_indexer_variants"] = variants
    target_b = sz.batches[min(1, len(sz.batches) - 1)]  # B = 8 on the H200
    for ctx in sz.contexts:
        entries = ctx // sz.csa_ratio
        for b in sz.batches:
            pool_entries = rounded(min(sz.sets * b * entries, sz.max_key_entries), sz.page)
            shape = {"ctx": ctx, "B": b, "entries": entries, "pool_entries": pool_entries}
            print(f"indexer {shape}", flush=True)
            pools = dict(zip(("bf16", "fp8"), key_pools(env, sz, pool_entries), strict=True))
            sets = indexer_sets(env, sz, b, entries, pool_entries // sz.page)
            cfg = indexer.shape_config(b, env.device)  # the baseline: "x before" is against it
            timed = {}
            for fmt, keys in pools.items():
                r = attempt(f"indexer {fmt}", time_indexer, env, sz, hw, shape, fmt, keys, cfg,
                            sets)  # fmt: skip
                timed[fmt] = r if "error" not in r else None
                rows.append(r if "error" not in r else {**shape, "format": fmt, **r})
            if timed["bf16"] and timed["fp8"]:
                timed["fp8"]["x_bf16"] = timed["fp8"]["us"] / timed["bf16"]["us"]
            for r in rows[-2:]:
                print_indexer(r)
            target = ctx == sz.contexts[-1] and b == target_b
            # (--smoke: the variants at the target shape only; their kernels' exactness at every
            # shape is tests/kernels/test_indexer.py's)
            for fmt, keys in pools.items() if target or not env.smoke else ():
                for name, vcfg in indexer_variants(env, b, entries, fmt).items():
                    r = attempt(f"variant {name}", time_indexer, env, sz, hw, shape, fmt, keys,
                                vcfg, sets)  # fmt: skip
                    r = {**shape, "format": fmt, "variant": name, **r}
                    if timed[fmt] and "error" not in r:
                        r["x_before"] = timed[fmt]["us"] / r["us"]
                    variants.append(r)
                    print_indexer(r)
                    if target and "error" not in r:  # score vs merge kernels, at the target
                        r["breakdown"] = breakdown(env, indexer_run(sz, keys, vcfg), sets[0])
            if target:
                for fmt, keys in pools.items():
                    print(f"  kernel breakdown, {fmt}:")
                    result[f"long_indexer_breakdown_{fmt}"] = breakdown(
                        env, indexer_run(sz, keys, cfg), sets[0]
                    )
                splits = sorted({max(1, cfg.num_splits // 2), cfg.num_splits, 2 * cfg.num_splits})
                for s in splits[: sz.alternatives]:
                    for prefetch in (True, False):
                        alt = dataclasses.replace(cfg, num_splits=s, prefetch=prefetch)
                        for fmt, keys in pools.items():
                            r = attempt("alternative", time_indexer, env, sz, hw, shape, fmt,
                                        keys, alt, sets)  # fmt: skip
                            alternatives.append(r)
                            print_indexer(r)
            del pools, sets
            free()
            save()
    for r in variants:
        if (r["format"], r["ctx"], r["B"], r["variant"]) == ("fp8", sz.contexts[-1], target_b,
                                                             "default"):  # fmt: skip
            result.setdefault("summary", {})["indexer_fp8_1M_B8_x_floor"] = r.get("x_floor")
            print(f"target indexer FP8 1M B={target_b} <= 1.5x floor: x{r.get('x_floor', 0):.2f}")
    for fmt in ("bf16", "fp8"):  # the fastest variant per shape, against shape_config
        for ctx in sz.contexts:
            for b in sz.batches:
                done = [
                    r
                    for r in variants
                    if (r["format"], r["ctx"], r["B"]) == (fmt, ctx, b) and "x_before" in r
                ]
                if done:
                    best = max(done, key=lambda r: r["x_before"])
                    print(
                        f"fastest variant {fmt} ctx={ctx >> 10}K B={b}: {best['variant']}"
                        f" {best['us']:.1f} us, {best['x_before']:.2f}x before,"
                        f" x{best['x_floor']:.2f} floor, top-k {100 * best['topk_overlap']:.1f}%"
                    )


PHASES = {
    "capacity": phase_capacity,
    "store": phase_store,
    "long-decode": phase_long_decode,
    "long-indexer": phase_long_indexer,
}


def run_phase(phase: str, out: str | None, smoke: bool) -> None:
    """One phase in this process: results merged into `out` after each section; a failure is
    recorded under result["errors"][phase] and exits non-zero."""
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench.kernels needs CUDA (use --smoke on CPU)")
    env = Env(torch.device("cpu" if smoke else "cuda"), smoke, quick=False, budget_ms=200.0)
    sizes = SMOKE if smoke else H200
    t0 = time.time()
    result = read_record(out)
    run = {"phase": phase, **prologue(env.device), "sizes": dataclasses.asdict(sizes)}
    result.setdefault("runs", []).append(run)
    result["timing"] = (
        f"median ms per call over CUDA-graph replays, {sizes.sets} rotating input sets per "
        "replay; floors = bytes read + written / measured copy bandwidth"
    )

    def save() -> None:
        run["wall_s"] = time.time() - t0
        write_record(out, result)

    try:
        hw = ceilings(env.device, env.smoke)  # the ceilings every bench divides by
        run["ceilings"] = hw
        print(f"{run['device']}, {run['sms']} SMs, copy {hw['copy_GBps']:.0f} GB/s", flush=True)
        PHASES[phase](env, sizes, result, hw, save)
        result.get("errors", {}).pop(phase, None)
    except Exception:
        traceback.print_exc()
        result.setdefault("errors", {})[phase] = traceback.format_exc()[-4000:]
        save()
        sys.exit(1)
    save()
