"""KV transfer throughput: one 32K-token DeepSeek-V4-Flash request state, pulled over NIXL.

A "prefill" process holds the request's KV; this process ("decode") reserves its own pages and
pulls it, against torch copying the same bytes. Page ids on both sides come from the engine's
LIFO free-list allocator after churn, so they are scattered as in service; staging blocks come
from the engine's block allocator after churn too. Descriptors travel over a multiprocessing
pipe (no Redis needed). Layouts:
  per-layer  one region per layer and kind ("csa.3.kv"), as the engine's pools are registered;
             one READ of every page (`KVTransfer.read`): descriptors = runs x layers
  fused      one region per kind, all layers in a page ("csa.kv", page [20, 64, 512]); one
             READ: descriptors = runs, each 20x larger (the layout the engine did not take)
  staged     the engine itself: `KVPool` (V4-Flash, bf16, pages of 64) and its staging blocks;
             the prefill side packs the request at hold time ("pack", timed there), the decode
             side pulls it chunk by chunk and scatters each chunk into its pages
             (`KVTransfer.pull` + `KVPool.unpacker`, what the decode service runs)
The per-layer and fused request (HF's default 43 layers: 20 CSA, 23 HCA) is 211 MiB:
  every layer   window ring 128 rows x 512                 -> group "swa", 2 pages
  CSA layers    32K/4 entries x 512 + indexer keys x 128   -> group "csa", 128 pages
  HCA layers    32K/128 entries x 512                      -> group "hca", 4 pages
the engine's (the window ring inside each kind's pages, plus the compressor rings) 218 MiB.
Rows: "nixl READ" / "nixl pull" (each timed from validation to the last byte in the decode
pages, bytes checked exactly once), "torch scattered" (index_select + index_copy_ of the same
pages, one process), "torch contiguous" (one copy_ of the same byte count: the ceiling; "x copy"
is each row's share of it). GB/s counts the request's bytes once.

CPU, two processes over loopback (UCX's default transports, i.e. cma for the data):
    .venv/bin/python -m bench.transfer --device cpu      # -> bench/results/cpu-transfer.json

Two GPUs of one host: prefill on cuda:0, decode on cuda:1, against torch's cuda:0 -> cuda:1
copy (one GPU: both on cuda:0, against a copy within it; -> h200-transfer.json). UCX_TLS
defaults to cuda_ipc,cuda_copy,tcp (without cuda_ipc, GPU memory crawls through the host); set
UCX_TLS in the environment to try others. The GPU machine has torch and numpy but no NIXL and
no network, so carry the nixl-cu13 wheel (59 MB; the device tool's working-tree limit is 64 MiB):
  1. here, in the repo root (.whl/ is git-ignored):
       .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1
  2. device run, kind nvidia-h200-x2, carry [".whl"], command:
       python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
         --target /tmp/site .whl/nixl_cu13-*.whl && export PYTHONPATH=/tmp/site || exit;
       PYTHONUNBUFFERED=1 python3 -m bench.transfer --device cuda --out $OUT/h200x2-transfer.json
  3. copy the returned JSON to bench/results/h200x2-transfer.json and commit it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import torch

from bench.harness import prologue, write_record
from dsaserve.engine.kv.allocator import PageAllocator
from dsaserve.engine.kv.layout import (
    SLAB,
    STAGING,
    KVBudgetError,
    KVCacheConfig,
    plan_pages,
    staging_block_bytes,
)
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.services.transfer import KVTransfer, Region, nixl_binding

LAYERS, WINDOW, HEAD, INDEX_HEAD, PAGE = 43, 128, 512, 128, 64
CSA_RATE, HCA_RATE = 4, 128
# HF DeepseekV4Config's default schedule for 43 layers.
LAYER_TYPES = ["hca"] * 2 + ["csa" if i % 2 else "hca" for i in range(LAYERS - 2)]

Layout = list[tuple[str, str, tuple[int, ...]]]  # (region name, group, page shape)


def layout(kind: str) -> Layout:
    """Region table of one worker's pools; every page is one page of bf16."""
    page = (PAGE, HEAD)
    csa = [i for i, t in enumerate(LAYER_TYPES) if t == "csa"]
    hca = [i for i, t in enumerate(LAYER_TYPES) if t == "hca"]
    if kind == "fused":
        return [
            ("swa.kv", "swa", (LAYERS, *page)),
            ("csa.kv", "csa", (len(csa), *page)),
            ("csa.idx", "csa", (len(csa), PAGE, INDEX_HEAD)),
            ("hca.kv", "hca", (len(hca), *page)),
        ]
    regions = [(f"swa.{i}.kv", "swa", page) for i in range(LAYERS)]
    for i in csa:
        regions += [(f"csa.{i}.kv", "csa", page), (f"csa.{i}.idx", "csa", (PAGE, INDEX_HEAD))]
    return regions + [(f"hca.{i}.kv", "hca", page) for i in hca]


def request_pages(tokens: int) -> dict[str, int]:
    return {
        "swa": WINDOW // PAGE,
        "csa": tokens // CSA_RATE // PAGE,
        "hca": tokens // HCA_RATE // PAGE,
    }


def churn(alloc: PageAllocator, need: int, rng: np.random.Generator) -> None:
    """Let requests of random sizes come and go ~8 times over `alloc` (a LIFO free list, as in
    service); those still live stay allocated, at least `need` pages stay free."""
    pages, live, handed = alloc.num_free, [], 0
    while handed < 8 * pages:
        if live and (alloc.num_free < pages // 4 or rng.random() < 0.5):
            alloc.free(live.pop(int(rng.integers(len(live)))))
        else:
            k = min(int(rng.integers(1, max(2, pages // 16))), alloc.num_free)
            live.append(alloc.allocate(k))
            handed += k
    while alloc.num_free < need:
        alloc.free(live.pop(int(rng.integers(len(live)))))


def churned_ids(pages: int, n: int, seed: int) -> list[int]:
    """The ids a request of n pages gets from a pool of `pages` after churn."""
    alloc = PageAllocator(pages)
    churn(alloc, n, np.random.default_rng(seed))
    return alloc.allocate(n)


@dataclass(frozen=True)
class Case:
    """One layout's pools and the request's page ids on both sides."""

    kind: str
    regions: Layout
    pages: dict[str, int]  # group -> pool pages (same on both sides)
    remote: dict[str, list[int]]  # group -> the request's pages at the prefill side
    local: dict[str, list[int]]  # group -> the pages decode reserved for it

    @classmethod
    def make(cls, kind: str, tokens: int, pool_factor: int) -> Case:
        pages = request_pages(tokens)
        pool = {g: n * pool_factor for g, n in pages.items()}
        remote = {g: churned_ids(pool[g], n, seed=1) for g, n in pages.items()}
        local = {g: churned_ids(pool[g], n, seed=2) for g, n in pages.items()}
        return cls(kind, layout(kind), pool, remote, local)


def make_pools(case: Case, device: torch.device, fill: bool) -> dict[str, torch.Tensor]:
    """One side's pools; with fill, each page holds `pattern` (so decode can check its bytes)."""
    pools = {}
    for k, (name, group, shape) in enumerate(case.regions):
        t = torch.zeros((case.pages[group], *shape), dtype=torch.bfloat16, device=device)
        if fill:
            rows = t.view(torch.int16).view(t.shape[0], -1)  # [pages, page elements]
            for first in range(0, t.shape[0], 64):  # in chunks: a fused page has ~700K elements
                ids = torch.arange(first, min(first + 64, t.shape[0]), device=device)
                rows[first : first + ids.numel()] = pattern(k, ids, rows.shape[1])
        pools[name] = t
    return pools


def pattern(region: int, ids: torch.Tensor, elems: int) -> torch.Tensor:
    """Known contents of pages `ids` of region number `region`: [len(ids), elems] int16."""
    col = torch.arange(elems, device=ids.device, dtype=torch.int32)
    return ((ids.to(torch.int32)[:, None] * 7919 + region * 104729 + col) % 32749).to(torch.int16)


def regions_of(case: Case, pools: dict[str, torch.Tensor]) -> list[Region]:
    return [Region(name, group, pools[name]) for name, group, _ in case.regions]


def prefill_main(case: Case, device: str, pipe: Connection) -> None:
    """The prefill side of a page READ: fill pools, send the descriptor, count notifications."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    pools = make_pools(case, dev, fill=True)
    with KVTransfer(f"bench-prefill-{case.kind}", regions_of(case, pools)) as transfer:
        pipe.send(transfer.descriptor())
        count_notifications(transfer, pipe)


def count_notifications(transfer: KVTransfer, pipe: Connection) -> None:
    """Count notifications until decode says how many to expect; answer with the count once
    all arrived (or after 60 s)."""
    notes, expected, deadline = 0, None, time.monotonic() + 600
    while time.monotonic() < deadline and (expected is None or notes < expected):
        notes += len(transfer.notifications())
        if expected is None and pipe.poll(0.001):
            expected, deadline = pipe.recv(), time.monotonic() + 60
    pipe.send(notes)


def synchronizer(*devices: torch.device) -> Callable[[], None]:
    """Waits for queued work on the CUDA devices among `devices` (CPU work is synchronous)."""
    cuda = {d for d in devices if d.type == "cuda"}

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    return sync


def timed(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of each of `iters` calls, after one untimed warm-up call."""
    fn()  # warm-up: connection set-up, allocations, first touch of pages
    sync()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def row(kind: str, method: str, nbytes: int, descs: int | None, seconds: list[float]) -> dict:
    med, best = statistics.median(seconds), min(seconds)
    return {
        "layout": kind,
        "method": method,
        "bytes": nbytes,
        "descriptors": descs,
        "median_s": med,
        "best_s": best,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / best / 1e9,
    }


def with_prefill(target: Callable, args: tuple, decode: Callable[[Connection], int]) -> None:
    """Run the prefill side in a spawned process while `decode(pipe)` pulls from it; decode
    returns how many notifications the prefill side must have got."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    prefill = ctx.Process(target=target, args=(*args, theirs))
    prefill.start()
    try:
        if ours not in wait([ours, prefill.sentinel], 300):
            raise RuntimeError(f"the prefill process sent nothing (exit code {prefill.exitcode})")
        sent = decode(ours)
        ours.send(sent)
        if not ours.poll(90) or ours.recv() != sent:
            raise RuntimeError("the prefill side did not get one notification per pull")
    finally:
        prefill.join(60)
        if prefill.is_alive():
            prefill.kill()


def nixl_row(case: Case, iters: int, src: torch.device, dst: torch.device) -> dict:
    """READs by this process from a spawned prefill process, checked for exact bytes."""
    stats, seconds = [], []

    def decode(pipe: Connection) -> int:
        pools = make_pools(case, dst, fill=False)
        with KVTransfer(f"bench-decode-{case.kind}", regions_of(case, pools)) as transfer:
            peer = transfer.add_peer(pipe.recv())

            def read() -> None:
                r = transfer.read(peer, case.remote, case.local, notify=b"bench", timeout_s=60)
                stats.append(r)

            seconds.extend(timed(read, iters, synchronizer(dst)))
            verify(case, pools)
        return len(stats)

    with_prefill(prefill_main, (case, str(src)), decode)
    return row(case.kind, "nixl READ", stats[-1].bytes, stats[-1].descriptors, seconds)


def verify(case: Case, pools: dict[str, torch.Tensor]) -> None:
    for k, (name, group, _) in enumerate(case.regions):
        t = pools[name]
        local = torch.tensor(case.local[group], device=t.device)
        got = t.view(torch.int16).view(t.shape[0], -1)[local]
        want = pattern(k, torch.tensor(case.remote[group], device=t.device), got.shape[1])
        if not torch.equal(got, want):
            raise AssertionError(f"region {name}: the READ delivered wrong bytes")


def torch_scattered(case: Case, iters: int, src_dev: torch.device, dst_dev: torch.device) -> dict:
    """The same pages moved by torch in one process: gather, one copy across, scatter."""
    src, dst = make_pools(case, src_dev, fill=False), make_pools(case, dst_dev, fill=False)
    r_idx = {g: torch.tensor(ids, device=src_dev) for g, ids in case.remote.items()}
    l_idx = {g: torch.tensor(ids, device=dst_dev) for g, ids in case.local.items()}

    def scattered() -> None:
        for name, group, _ in case.regions:
            pages = src[name].index_select(0, r_idx[group]).to(dst_dev, non_blocking=True)
            dst[name].index_copy_(0, l_idx[group], pages)

    nbytes = sum(src[name][0].nbytes * len(case.remote[group]) for name, group, _ in case.regions)
    seconds = timed(scattered, iters, synchronizer(src_dev, dst_dev))
    return row(case.kind, "torch scattered", nbytes, None, seconds)


def torch_contiguous(
    kind: str, nbytes: int, iters: int, src_dev: torch.device, dst_dev: torch.device
) -> dict:
    """The same byte count in one copy: the ceiling."""
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)

    def contiguous() -> None:
        flat_dst.copy_(flat_src, non_blocking=True)

    seconds = timed(contiguous, iters, synchronizer(src_dev, dst_dev))
    return row(kind, "torch contiguous", nbytes, None, seconds)


V4_FLASH = ModelConfig.from_hf({"model_type": "deepseek_v4"})  # HF's defaults: V4-Flash


def flash_pool(tokens: int, pool_factor: int, device: torch.device) -> KVPool:
    """The engine's V4-Flash pools (bf16, pages of 64) with pages for `pool_factor` requests of
    `tokens` tokens, and staging blocks for as many."""
    block = staging_block_bytes(V4_FLASH, PAGE, 2)
    want = {
        "csa": pool_factor * (WINDOW // PAGE + -(-tokens // CSA_RATE // PAGE)),
        "hca": pool_factor * (WINDOW // PAGE + -(-tokens // HCA_RATE // PAGE)),
    }
    staging = pool_factor * (sum(want.values()) // pool_factor + 8) * block

    def kv(budget: int) -> KVCacheConfig:
        return KVCacheConfig(budget, PAGE, pool_factor, PAGE, staging_bytes=staging)

    def enough(budget: int) -> bool:
        try:
            pages = plan_pages(V4_FLASH, kv(budget), 2, block)[0]
        except KVBudgetError:
            return False
        return all(pages[g] >= n for g, n in want.items())

    low, high = 1, 1 << 40  # the smallest budget that holds them lies between
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return KVPool(V4_FLASH, kv(high), dtype=torch.bfloat16, device=device)


def churned_pages(pool: KVPool, tokens: int, seed: int) -> dict[str, list[int]]:
    """A request's pages and slab row after churn in each of the pool's allocators."""
    rng = np.random.default_rng(seed)
    pages = {}
    for name, group in pool.groups.items():
        n = pool.pages_for(name, tokens)
        churn(group.allocator, n, rng)
        pages[name] = group.allocator.allocate(n)
    churn(pool.slab, 1, rng)
    pages[SLAB] = pool.slab.allocate(1)
    return pages


def state_regions(pool: KVPool) -> list[Region]:
    return [Region(r.name, r.group, r.tensor) for r in pool.regions()]


def staged_prefill_main(
    tokens: int, pool_factor: int, device: str, iters: int, pipe: Connection
) -> None:
    """The prefill side of a pull: the request's pages hold `pattern`; its state is staged as
    the prefill service does it (after churn of the staging blocks too), timed; then the
    descriptor, the pages and blocks go to decode, and notifications are counted."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    pool = flash_pool(tokens, pool_factor, dev)
    pages = churned_pages(pool, tokens, seed=1)
    for k, r in enumerate(pool.regions()):
        if r.group != STAGING:
            ids = torch.tensor(pages[r.group], device=dev)
            r.tensor.view(torch.int16).view(r.tensor.shape[0], -1)[ids] = pattern(
                k, ids, r.tensor[0].numel()
            )
    need = -(-pool.cells(pages).size // pool.staging.cells_per_block)
    churn(pool.staging.allocator, need, np.random.default_rng(3))
    pack = timed(lambda: pool.staging.free(pool.stage(pages)), iters, synchronizer(dev))
    blocks = pool.stage(pages)
    with KVTransfer("bench-prefill-staged", state_regions(pool)) as transfer:
        pipe.send((transfer.descriptor(), pages, blocks, pack))
        count_notifications(transfer, pipe)


def staged_rows(
    tokens: int, pool_factor: int, iters: int, src: torch.device, dst: torch.device
) -> list[dict]:
    """Pulls by this process of the state a spawned prefill process staged, checked for exact
    bytes; and that process's packing."""
    stats, seconds, sent = [], [], {}

    def decode(pipe: Connection) -> int:
        pool = flash_pool(tokens, pool_factor, dst)
        local = churned_pages(pool, tokens, seed=2)
        with KVTransfer("bench-decode-staged", state_regions(pool)) as transfer:
            descriptor, sent["pages"], blocks, sent["pack"] = pipe.recv()
            peer = transfer.add_peer(descriptor)

            def pull() -> None:  # what the decode service does per request
                unpack = pool.unpacker(local)
                ring = pool.staging.ring
                r = transfer.pull(
                    peer,
                    STAGING,
                    blocks,
                    ring,
                    unpack.nbytes,
                    unpack,
                    notify=b"bench",
                    timeout_s=60,
                )
                stats.append(r)
                sent["bytes"] = unpack.nbytes

            seconds.extend(timed(pull, iters, synchronizer(dst)))
            verify_staged(pool, local, sent["pages"])
        return len(stats)

    with_prefill(staged_prefill_main, (tokens, pool_factor, str(src), iters), decode)
    nbytes = sent["bytes"]
    return [
        row("staged", "nixl pull", nbytes, stats[-1].descriptors, seconds),
        row("staged", "pack (prefill)", nbytes, None, sent["pack"]),
    ]


def verify_staged(pool: KVPool, local: dict[str, list[int]], remote: dict[str, list[int]]) -> None:
    for k, r in enumerate(pool.regions()):
        if r.group == STAGING:
            continue
        dev = r.tensor.device
        pages = r.tensor.view(torch.int16).view(r.tensor.shape[0], -1)
        got = pages[torch.tensor(local[r.group], device=dev)]
        want = pattern(k, torch.tensor(remote[r.group], device=dev), got.shape[1])
        if not torch.equal(got, want):
            raise AssertionError(f"region {r.name}: the pull delivered wrong bytes")


def config(args: argparse.Namespace, load: float) -> dict:
    cuda = args.device == "cuda"
    return {
        **prologue(args.device),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else None,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_1m_at_start": load,  # the CPU machine is shared: a high load skews CPU rows
        "nixl": nixl_binding.api.__name__,
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "tokens": args.tokens,
        "page": PAGE,
        "layer_types": LAYER_TYPES,
        "request_pages": request_pages(args.tokens),
        "pool_factor": args.pool_factor,
        "iters": args.iters,
        "command": " ".join(["python", *sys.argv]),
    }


def with_copy_share(results: list[dict]) -> None:
    """Each row's median GB/s as a share of its layout's "torch contiguous" median."""
    ceiling = {r["layout"]: r["gbps_median"] for r in results if r["method"] == "torch contiguous"}
    for r in results:
        r["x_copy"] = r["gbps_median"] / ceiling[r["layout"]]


def print_table(results: list[dict]) -> None:
    print(
        f"{'layout':10} {'method':17} {'MiB':>6} {'descs':>6} {'median ms':>10} "
        f"{'GB/s':>7} {'best GB/s':>10} {'x copy':>7}"
    )
    for r in results:
        descs = "" if r["descriptors"] is None else r["descriptors"]
        print(
            f"{r['layout']:10} {r['method']:17} {r['bytes'] / 2**20:6.1f} {descs:>6} "
            f"{r['median_s'] * 1e3:10.2f} {r['gbps_median']:7.2f} {r['gbps_best']:10.2f} "
            f"{r['x_copy']:7.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layouts", default="per-layer,fused,staged", help="comma-separated subset")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--pool-factor", type=int, default=4, help="pool pages = request pages x this")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, help="default: bench/results/<cpu|h200x2>-transfer.json")
    args = p.parse_args()

    if args.device == "cuda":
        if torch.cuda.device_count() == 0:
            raise SystemExit("--device cuda needs a GPU")
        os.environ.setdefault("UCX_TLS", "cuda_ipc,cuda_copy,tcp")  # the prefill inherits it
        # One GPU: both processes on it (cuda_ipc within the device), against a local copy.
        src, dst = (
            torch.device("cuda:0"),
            torch.device(f"cuda:{min(1, torch.cuda.device_count() - 1)}"),
        )
        torch.cuda.set_device(dst)  # UCX registers decode's pools in this device's context
    else:
        src = dst = torch.device("cpu")
    load = os.getloadavg()[0]
    results = []
    for kind in args.layouts.split(","):
        if kind == "staged":
            results += staged_rows(args.tokens, args.pool_factor, args.iters, src, dst)
        else:
            case = Case.make(kind, args.tokens, args.pool_factor)
            results.append(nixl_row(case, args.iters, src, dst))
            results.append(torch_scattered(case, args.iters, src, dst))
        results.append(torch_contiguous(kind, results[-1]["bytes"], args.iters, src, dst))
    with_copy_share(results)

    print_table(results)
    tag = "cpu" if args.device == "cpu" else "h200" if src == dst else "h200x2"
    out = args.out or Path(__file__).parent / "results" / f"{tag}-transfer.json"
    write_record(out, {"config": config(args, load), "results": results}, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
