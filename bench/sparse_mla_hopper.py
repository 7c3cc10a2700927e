"""H200: the Gluon sparse-MLA decode (kernels.hopper.sparse_mla) against the Triton one
(kernels.sparse_mla) and plain torch, correctness first.

    python -m bench.sparse_mla_hopper --out bench/results/h200-sparse-mla-hopper.json
    python -m bench.sparse_mla_hopper --only check      # correctness only

Phases, each in its own process under a time limit (a hung kernel loses one phase, not the run):
- ``check``: the Gluon kernel against float64 (kernels.reference on the used rows) on fresh
  random inputs with holes (-1 and out-of-pool ids), ragged lengths, an empty row, sinks or
  none, at V4 (64 heads, 512 wide) and V3.2 (128 heads, 576 wide) shapes, odd index counts,
  forced split counts, fp16, and a CUDA graph replayed on new inputs; the same inputs through
  the Triton kernel for its error beside it.
- ``once`` (not in the default run): one call of each target shape, for a profiler.
- ``bench``: bench.kernels' decode shapes (V4-Flash B = 1..128, V3.2 B = 1..128, 4096 prefill
  rows): medians of CUDA-graph replays cycling through 4 input sets over a 4M-slot pool (so
  gathered rows come from HBM), plain torch and the Triton kernel in the same run, TFLOP/s and
  gathered GB/s against the ceilings measured in the same run, a few split counts beside the
  default, and the Gluon path's kernels one by one at the two target shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from bench.compare import rel_err_or_nan
from bench.harness import attempt, ceilings, kernel_breakdown, prologue, time_ms, write_record
from bench.kernels import (
    POOL_SLOTS,
    PREFILL,
    V4,
    V32,
    DecodeShape,
    decode_error,
    decode_inputs,
    torch_decode,
    triton_decode,
)
from dsaserve import kernels
from dsaserve.kernels import reference

DEV = torch.device("cuda")


def gluon_decode(splits: int | None):
    from dsaserve.kernels.hopper import sparse_mla as hop

    def run(q, kv, idx, lengths, sinks):
        return hop.sparse_mla_decode(
            q, kv, idx, q.shape[-1] ** -0.5, sinks=sinks, lengths=lengths, num_splits=splits
        )

    return run


def _case(batch, heads, dim, num_idx, slots, dtype, sinks, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    q = torch.randn(batch, heads, dim, device=DEV, generator=g).to(dtype)
    kv = torch.randn(slots, dim, device=DEV, generator=g).to(dtype)
    idx = torch.randint(0, slots, (batch, num_idx), device=DEV, generator=g, dtype=torch.int32)
    holes = torch.rand(batch, num_idx, device=DEV, generator=g)
    idx[holes < 0.1] = -1
    idx[holes > 0.97] = slots + 3  # outside the pool: skipped like -1
    lengths = torch.randint(0, num_idx + 1, (batch,), device=DEV, generator=g, dtype=torch.int32)
    lengths[0] = 0  # an empty row
    lengths[-1] = num_idx
    sink = torch.randn(heads, device=DEV, generator=g) if sinks else None
    return q, kv, idx, lengths, sink


def _err64(out, lse, q, kv, idx, lengths, sinks) -> tuple[float, float]:
    used, local = torch.unique(idx.long().clamp(min=0, max=kv.shape[0] - 1), return_inverse=True)
    local = local.int().masked_fill((idx < 0) | (idx >= kv.shape[0]), -1)
    ref, ref_lse = reference.sparse_mla_decode(
        q.double(), kv[used].double(), local, q.shape[-1] ** -0.5, sinks=sinks, lengths=lengths
    )
    out_err = rel_err_or_nan(out, ref)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse finite where the reference is not"
    assert bool((out[~finite].float() == 0).all()), "a row without entries is not 0"
    lse_err = rel_err_or_nan(lse, ref_lse)  # (over the finite entries)
    return out_err, lse_err


CHECKS = [  # batch, heads, dim, num_idx, dtype, sinks, splits (None: default)
    (1, 64, 512, 640, torch.bfloat16, True, None),
    (64, 64, 512, 640, torch.bfloat16, True, None),
    (64, 64, 512, 640, torch.bfloat16, False, 1),
    (7, 64, 512, 1000, torch.bfloat16, True, 3),
    (5, 128, 512, 100, torch.float16, True, 2),
    (3, 128, 576, 2048, torch.bfloat16, False, None),
    (64, 128, 576, 2048, torch.bfloat16, False, 1),
    (9, 128, 576, 2047, torch.bfloat16, True, 7),
    (300, 64, 512, 640, torch.bfloat16, True, None),
    (2, 64, 512, 64, torch.bfloat16, True, 1),
    (2, 64, 576, 1, torch.bfloat16, True, 1),
]


def phase_check(result: dict) -> None:
    rows = []
    for i, (batch, heads, dim, num_idx, dtype, sinks, splits) in enumerate(CHECKS):
        args = _case(batch, heads, dim, num_idx, 1 << 16, dtype, sinks, seed=i)
        g_err = _err64(*gluon_decode(splits)(*args), *args)  # a NaN anywhere fails the norm
        t_err = _err64(*triton_decode(None)(*args), *args)
        row = dict(
            B=batch, H=heads, D=dim, K=num_idx, dtype=str(dtype), sinks=sinks, splits=splits,
            gluon_out_err=g_err[0], gluon_lse_err=g_err[1],
            triton_out_err=t_err[0], triton_lse_err=t_err[1],
        )  # fmt: skip
        ok = g_err[0] < 1e-2 and g_err[1] < 1e-4
        row["ok"] = ok
        rows.append(row)
        print(
            f"  {'ok ' if ok else 'BAD'} B={batch:<4} H={heads} D={dim} K={num_idx:<5} {dtype} "
            f"sinks={sinks} splits={splits}: gluon out {g_err[0]:.1e} lse {g_err[1]:.1e} | "
            f"triton out {t_err[0]:.1e} lse {t_err[1]:.1e}",
            flush=True,
        )
    # a captured graph replayed on new inputs (no host sync in the call)
    args = list(_case(8, 64, 512, 640, 1 << 16, torch.bfloat16, True, seed=99))
    fn = gluon_decode(None)
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fn(*args)
    fresh = _case(8, 64, 512, 640, 1 << 16, torch.bfloat16, True, seed=100)
    for buf, new in zip(args, fresh, strict=True):
        buf.copy_(new)
    graph.replay()
    g_err = _err64(out, lse, *fresh)
    rows.append({"graph_replay_out_err": g_err[0], "ok": g_err[0] < 1e-2})
    print(f"  graph replay on new inputs: out {g_err[0]:.1e}", flush=True)
    result["check"] = rows
    result["check_ok"] = all(r["ok"] for r in rows)


def _row(shape: DecodeShape, kind: str, us: float, hw: dict) -> dict:
    r = {"shape": shape.name, "B": shape.batch, "H": shape.heads, "D": shape.dim}
    r.update(K=shape.num_idx, kernel=kind, us=us)
    r["TFLOPs"] = shape.flop / us / 1e6
    r["GBps"] = shape.gathered_bytes / us / 1e3
    r["share_matmul"] = r["TFLOPs"] / hw["bf16_matmul_TFLOPs"]
    r["share_copy"] = r["GBps"] / hw["copy_GBps"]
    return r


def phase_bench(result: dict) -> None:
    hw = ceilings(DEV)
    result["ceilings"] = hw
    print(f"  ceilings: {hw}", flush=True)
    runs = []
    pools: dict[int, torch.Tensor] = {}
    for shape in V4 + V32 + PREFILL:
        if shape.dim not in pools:
            pools.clear()
            torch.cuda.empty_cache()
            pools[shape.dim] = torch.randn(POOL_SLOTS, shape.dim, device=DEV, dtype=torch.bfloat16)
        sets = decode_inputs(shape, pools[shape.dim])
        from dsaserve.kernels.hopper import sparse_mla as hop

        default = hop.default_splits(shape.batch, shape.heads, shape.num_idx, DEV)
        variants = [("torch", torch_decode), ("triton", triton_decode(None))]
        variants.append((f"gluon s{default}", gluon_decode(None)))
        if shape.batch in (1, 64):
            for s in (1, 2, 4, 8):
                if s != default:
                    variants.append((f"gluon s{s}", gluon_decode(s)))
        rows = []
        for kind, fn in variants:
            us = attempt(f"{shape.name} B={shape.batch} {kind}", time_ms, fn, sets)
            if not isinstance(us, float):
                continue
            r = _row(shape, kind, 1e3 * us, hw)
            if kind.startswith("gluon"):
                r["rel_err"] = attempt("err", decode_error, gluon_decode(None), *sets[0])
            rows.append(r)
        base = {r["kernel"]: r["us"] for r in rows}
        for r in rows:
            r["x_torch"] = base.get("torch", float("nan")) / r["us"]
            r["x_triton"] = base.get("triton", float("nan")) / r["us"]
            print(
                f"  {shape.name:>10} B={shape.batch:<5} {r['kernel']:<10} {r['us']:8.1f} us "
                f"{r['TFLOPs']:6.1f} TF/s {r['GBps']:6.0f} GB/s {100 * r['share_matmul']:4.1f}% mm "
                f"{100 * r['share_copy']:4.1f}% copy  x{r['x_torch']:5.2f} torch "
                f"x{r['x_triton']:5.2f} triton",
                flush=True,
            )
        if (shape.name, shape.batch) in (("v4-flash", 64), ("v3.2", 64)):
            print(f"  kernels, {shape.name} B={shape.batch}:")
            result[f"breakdown_{shape.name}_b{shape.batch}"] = attempt(
                "breakdown", kernel_breakdown, gluon_decode(None), sets[0]
            )
        runs.append(rows)
        result["bench"] = runs
    summarize(runs)


def summarize(runs: list[list[dict]]) -> None:
    print("\n| shape | B | torch us | Triton us | Gluon us (splits) | TFLOP/s | % mm | x torch "
          "| x Triton |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in runs:
        by = {r["kernel"]: r for r in rows}
        glu = min((r for r in rows if r["kernel"].startswith("gluon")), key=lambda r: r["us"])
        print(
            f"| {glu['shape']} | {glu['B']} | {by.get('torch', {}).get('us', float('nan')):.1f} "
            f"| {by.get('triton', {}).get('us', float('nan')):.1f} | {glu['us']:.1f} "
            f"({glu['kernel'][6:]}) | {glu['TFLOPs']:.0f} | {100 * glu['share_matmul']:.0f} "
            f"| {glu['x_torch']:.2f} | {glu['x_triton']:.2f} |"
        )


def phase_once(result: dict) -> None:
    """One warm-up call, then one call, of V4-Flash B=64 (default splits) and V3.2 B=64
    (one split): for a profiler (ncu --launch-skip 2 --launch-count 2 -k regex:_sparse_mla)."""
    for shape in (V4[3], V32[2]):
        pool = torch.randn(POOL_SLOTS, shape.dim, device=DEV, dtype=torch.bfloat16)
        args = decode_inputs(shape, pool)[0]
        for _ in range(2):
            gluon_decode(None)(*args)
        torch.cuda.synchronize()
        del pool


PHASES = {"check": (phase_check, 120), "bench": (phase_bench, 300), "once": (phase_once, 120)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/h200-sparse-mla-hopper.json")
    ap.add_argument("--only", choices=sorted(PHASES))
    args = ap.parse_args()
    kernels.sparse_mla_decode  # noqa: B018  (kernels.env picks the backend before triton loads)
    if args.only:
        part: dict = {}
        try:
            PHASES[args.only][0](part)
        finally:
            write_record(f"{args.out}.{args.only}", part)
        return
    result = prologue(DEV)
    for name, (_, limit) in PHASES.items():
        if name == "once":
            continue
        print(f"== {name}", flush=True)
        cmd = [sys.executable, "-m", "bench.sparse_mla_hopper", "--only", name, "--out", args.out]
        try:
            rc = subprocess.run(cmd, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        part_path = f"{args.out}.{name}"
        if os.path.exists(part_path):
            with open(part_path) as f:
                result.update(json.load(f))
            os.remove(part_path)
        result[f"{name}_rc"] = rc
        write_record(args.out, result)


if __name__ == "__main__":
    main()
