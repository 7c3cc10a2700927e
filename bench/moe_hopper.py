"""H200: the Gluon FP4 MoE (kernels.hopper.fp4_moe) against the Triton one (kernels.fp4_moe),
correctness first, then one V4-Flash MoE layer at decode and prefill token counts.

    python -m bench.moe_hopper --out bench/results/h200-moe-hopper.json
    python -m bench.moe_hopper --only check      # correctness only

Phases, each in its own process under a time limit (a hung kernel loses one phase, not the run):
- ``check``: both kernels against the release's expert arithmetic (kernels.quant) on fresh
  random inputs: V4-Flash widths (hidden 4096, intermediate 2048) with 32 experts at 1, 64 and
  300 tokens (skewed routing: one expert takes most rows), a small odd case (hidden 1536,
  intermediate 512, 5 tokens, top-3), expert-parallel halves (ids outside a rank's range),
  every default config and a few forced ones, and a CUDA-graph capture replayed on new inputs.
- ``bench``: 256 experts, top-6, at 1, 8, 64, 256 and 4096 tokens: medians of graph replays
  that cycle through routings until a replay reads > 192 MB of weights (so they come from
  HBM, not L2); GB/s of FP4 weights read and its share of the copy rate measured in the same
  run; the Gluon path's kernels one by one (torch profiler).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys

import torch

from bench.compare import rel_err_or_nan
from bench.harness import Env, attempt, ceilings, kernel_breakdown, prologue, timed, write_record
from dsaserve import kernels  # noqa: F401  (before triton: on CPU, kernels.env picks the interpreter)
from dsaserve.kernels import quant
from dsaserve.kernels.fp4_moe import default_config as triton_config
from dsaserve.kernels.fp4_moe import fp4_moe

ROTATE_BYTES = 192 << 20
LIMIT = 10.0


def layer(e: int, h: int, i: int, dev: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Random FP4 codes with scales near 2^-7 (speed does not depend on the values)."""
    g = torch.Generator(dev).manual_seed(seed)

    def scales(*shape):
        return (
            torch.randint(118, 123, shape, device=dev, generator=g, dtype=torch.int32)
            .to(torch.uint8)
            .view(torch.float8_e8m0fnu)
        )

    w13 = torch.randint(-128, 128, (e, 2 * i, h // 2), device=dev, generator=g, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (e, h, i // 2), device=dev, generator=g, dtype=torch.int8)
    return w13, scales(e, 2 * i, h // 32), w2, scales(e, h, i // 32)


def routing(
    tokens: int, e: int, h: int, topk: int, dev: torch.device, seed: int, skew: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(dev).manual_seed(seed)
    x = (torch.randn(tokens, h, device=dev, generator=g) * 2).to(torch.bfloat16)
    scores = torch.rand(tokens, e, device=dev, generator=g)
    if skew:  # expert 1 in most tokens' top-k: one expert with many rows, many with few
        scores[: tokens * 3 // 4, 1] += 2.0
    w, ids = scores.topk(topk, dim=1)
    return x, ids, (w / w.sum(1, keepdim=True) * 1.5).float()


# ---- check ----------------------------------------------------------------------------------


def phase_check(dev: torch.device, result: dict) -> None:
    from dsaserve.kernels.hopper import fp4_moe as hop

    rows = []

    def case(name, e, h, i, tokens, topk, skew, configs, seed, ep=False):
        w = layer(e, h, i, dev, seed)
        x, ids, wts = routing(tokens, e, h, topk, dev, seed + 1, skew)
        ranges = [(0, e)] + ([(0, e // 2), (e // 2, e)] if ep else [])
        for start, stop in ranges:
            local = [t[start:stop] for t in w]
            ref = quant.fp4_experts_reference(x, ids - start, wts, *local, LIMIT)
            tri = fp4_moe(x, ids - start, wts, *local, LIMIT)
            for cfg in configs:
                label = f"{name} experts[{start}:{stop}] {cfg or 'default'}"
                out = attempt(
                    label, hop.fp4_moe_hopper, x, ids - start, wts, *local, LIMIT, config=cfg
                )
                if isinstance(out, dict):
                    rows.append({"case": label, **out, "ok": False})
                    continue
                torch.cuda.synchronize()
                r = {
                    "case": label,
                    "rel_err": rel_err_or_nan(out, ref),
                    "triton_rel_err": rel_err_or_nan(tri, ref),
                    "vs_triton": rel_err_or_nan(out, tri),
                    "finite": bool(torch.isfinite(out).all()),
                }
                r["ok"] = r["finite"] and r["rel_err"] < 4e-3
                rows.append(r)
                print(
                    f"  {'ok  ' if r['ok'] else 'FAIL'} {label}: rel err {r['rel_err']:.2e} "
                    f"(triton {r['triton_rel_err']:.2e}, gluon vs triton {r['vs_triton']:.2e})",
                    flush=True,
                )

    forced = [
        None,
        hop.HopperMoeConfig(8, 5, (1, 1), "fp8"),
        hop.HopperMoeConfig(16, 4, (2, 4), "fp8"),
        hop.HopperMoeConfig(8, 3, (1, 1), "shift"),
        hop.HopperMoeConfig(16, 4, (2, 4), "shift"),
    ]
    case("v4-flash T=1", 32, 4096, 2048, 1, 6, False, forced, 1, ep=True)
    case("v4-flash T=64", 32, 4096, 2048, 64, 6, True, forced, 3, ep=True)
    case(
        "v4-flash T=300",
        32,
        4096,
        2048,
        300,
        6,
        True,
        [
            None,
            hop.HopperMoeConfig(64, 2, (1, 1), "shift"),
            hop.HopperMoeConfig(64, 3, (1, 1), "fp8"),
        ],
        5,
    )
    case("odd h1536 i512 T=5 top3", 7, 1536, 512, 5, 3, False, [None], 7)

    # graph capture: replays follow new routings and inputs
    w = layer(16, 1024, 512, dev, 9)
    x, ids, wts = routing(8, 16, 1024, 6, dev, 10)
    hop.fp4_moe_hopper(x, ids, wts, *w, LIMIT)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = hop.fp4_moe_hopper(x, ids, wts, *w, LIMIT)
    x2, ids2, wts2 = routing(8, 16, 1024, 6, dev, 11)
    x.copy_(x2), ids.copy_(ids2), wts.copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    ref = quant.fp4_experts_reference(x, ids, wts, *w, LIMIT)
    g = {"case": "graph replay, new inputs", "rel_err": rel_err_or_nan(y, ref)}
    g["ok"] = g["rel_err"] < 4e-3
    rows.append(g)
    print(f"  {'ok  ' if g['ok'] else 'FAIL'} graph replay: rel err {g['rel_err']:.2e}")
    result["check"] = rows
    result["check_ok"] = all(r.get("ok") for r in rows)


# ---- bench ----------------------------------------------------------------------------------


def phase_bench(dev: torch.device, result: dict) -> None:
    from dsaserve.kernels.hopper import fp4_decode, fp4_gemm
    from dsaserve.kernels.hopper import fp4_moe as hop

    env = Env(dev, smoke=False, quick=True)
    hw = ceilings(dev)
    result["ceilings"] = hw
    e, h, i, topk = 256, 4096, 2048, 6
    w = layer(e, h, i, dev, 0)
    per_expert = sum(t[0].numel() for t in w)  # bytes: int8 codes + e8m0 scales
    runs = []
    for tokens in (1, 8, 64, 256, 4096):
        x, ids, wts = routing(tokens, e, h, topk, dev, tokens)
        active = int(torch.unique(ids).numel())
        nbytes = active * per_expert
        sets = [(x, ids, wts)] + [
            routing(tokens, e, h, topk, dev, tokens + 1000 * r)
            for r in range(1, max(1, math.ceil(ROTATE_BYTES / nbytes)))
        ]
        rows = hop.default_config(
            tokens * topk, e, h, i, torch.cuda.get_device_properties(dev).multi_processor_count
        )

        others = [
            dataclasses.replace(
                rows,
                decode=d,
                stages=min(6, fp4_gemm.SMEM_BUDGET // fp4_gemm.stage_bytes(rows.block_t, d)),
            )
            for d in fp4_decode.DECODES
            if d != rows.decode
        ]
        if tokens == 1:  # fewer / more K slices for the step that cannot fill the GPU
            others += [dataclasses.replace(rows, split_k=s) for s in ((2, 2), (8, 4))]
        variants = [("triton", None), ("gluon", None)] + [("gluon", c) for c in others]
        run_rows = []
        for kind, cfg in variants:
            if kind == "triton":
                used = triton_config(tokens * topk, e, dev)

                def fn(x, ids, wts):
                    return fp4_moe(x, ids, wts, *w, LIMIT)
            else:
                used = cfg or rows

                def fn(x, ids, wts, cfg=cfg):
                    return hop.fp4_moe_hopper(x, ids, wts, *w, LIMIT, config=cfg)

            t = attempt(f"{kind} T={tokens}", timed, env, fn, sets)
            r = {"kernel": kind, "config": dataclasses.asdict(used), "default": cfg is None}
            if isinstance(t, tuple):
                r["us"], r["timing"] = 1e3 * t[0], t[1]
                r["GBps"] = nbytes / r["us"] / 1e3
                r["share_copy"] = r["GBps"] / hw["copy_GBps"]
            else:
                r.update(t)
            if kind == "gluon" and cfg is None:
                r["kernels_us"] = attempt("gluon kernels", kernel_breakdown, fn, sets[0])
            run_rows.append(r)
            us, gbps, share = (r.get(k, float("nan")) for k in ("us", "GBps", "share_copy"))
            print(
                f"  T={tokens:<5} {kind:6} {r['config']}: {us:9.1f} us {gbps:6.0f} GB/s "
                f"({100 * share:4.1f}% of copy)",
                flush=True,
            )
        base = next((r["us"] for r in run_rows if r["kernel"] == "triton" and "us" in r), None)
        for r in run_rows:
            if base and "us" in r:
                r["x_triton"] = base / r["us"]
        runs.append(
            {"tokens": tokens, "active_experts": active, "fp4_MB": nbytes / 1e6, "rows": run_rows}
        )
        result["bench"] = runs
    print("\n| tokens | experts hit | MB | Triton us | Gluon us | x Triton | Gluon GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        tri = next((r for r in run["rows"] if r["kernel"] == "triton"), {})
        glu = min(
            (r for r in run["rows"] if r["kernel"] == "gluon" and "us" in r),
            key=lambda r: r["us"],
            default={},
        )
        print(
            f"| {run['tokens']} | {run['active_experts']} | {run['fp4_MB']:.0f} | "
            f"{tri.get('us', float('nan')):.1f} | {glu.get('us', float('nan')):.1f} | "
            f"{tri.get('us', float('nan')) / glu.get('us', float('nan')):.2f} | "
            f"{glu.get('GBps', float('nan')):.0f} | "
            f"{100 * glu.get('share_copy', float('nan')):.0f} |"
        )


PHASES = {"check": (phase_check, 200), "bench": (phase_bench, 360)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/h200-moe-hopper.json")
    ap.add_argument("--only", choices=sorted(PHASES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.only:
        part: dict = {}
        try:
            PHASES[args.only][0](dev, part)
        finally:
            write_record(f"{args.out}.{args.only}", part)
        return
    result = prologue(dev)
    for name, (_, limit) in PHASES.items():
        print(f"== {name}", flush=True)
        cmd = [sys.executable, "-m", "bench.moe_hopper", "--only", name, "--out", args.out]
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
