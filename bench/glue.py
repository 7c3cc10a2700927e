"""H200 benchmark of the fused decode glue (kernels.fused_*) against the engine's torch sequences.

    python -m bench.glue                        # -> bench/results/h200-glue.json
    python -m bench.glue --only mhc             # one phase, in this process
    python -m bench.glue --smoke                # CPU: tiny model, Triton interpreter, no timing

Phases (each its own process by default, so a fault in one cannot poison the next one's CUDA
context; each merges its rows into the JSON as soon as it has them):
- ``compressor``: the compressors' decode path, CSA main (overlap, 512-d), CSA indexer (overlap,
  128-d), HCA (rate 128);
- ``indexer``: the indexer's query side and the sparse-MLA index lists of SWA, CSA and HCA
  layers (HCA columns as wide as a decode graph's: 1M // 128 + 1);
- ``mhc``: mHC before a sublayer, with and without the previous sublayer's write-back, and the
  last write-back alone;
- ``attention``: attention's pre (q and kv norm + RoPE, scratch and ring writes) and post
  (inverse RoPE) glue.

Every op runs on a real KVPool/StepState of V4-Flash's widths (bench.fused_cases) at B = 1 and
64 decode rows around 32K tokens of context, the compressors also with every row closing a
window. Per op: the Triton kernels against the torch sequence they replace
(kernels.fused_reference: on a GPU it calls the same row-wise Triton kernels the engine calls),
checked first (relative error, share of bitwise-equal elements), then both timed as medians of
CUDA-event-timed CUDA-graph replays of REPEAT back-to-back calls (eager if capture fails, noted),
their device launches counted with the profiler, and the fused time set against the op's byte
floor at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch

from bench.fused_cases import GlueStep, Op, compare, model_config, paired
from bench.harness import attempt, fmt, launches, prologue, read_record, time_ms_any, write_record
from dsaserve import kernels  # (before triton: on CPU, kernels.env picks the interpreter)
from dsaserve.engine.models.deepseek_v4.config import CSA, HCA, SLIDING
from dsaserve.engine.profile import hardware

DEFAULT_OUT = "bench/results/h200-glue.json"
REPEAT = 20  # calls per timed graph: back to back, as the kernels run inside a decode step
MAX_CONTEXT = 1 << 20  # V4-Flash's: sets the HCA index lists' width in decode graphs
CONTEXT = 32768
BATCHES = (1, 64)
SMOKE_POSITIONS = [0, 3, 7, 15, 18, 47, 63, 100]
PHASES: dict[str, list[Callable[[GlueStep], Op]]] = {  # each op built and measured on its own
    "compressor": [lambda s, k=k: s.compress(k) for k in ("csa", "index", "hca")],
    "indexer": [lambda s: s.indexer_query()]
    + [lambda s, k=k: s.sparse_indices(k) for k in (SLIDING, CSA, HCA)],
    "mhc": [
        lambda s: s.hc_pre(merge=False),
        lambda s: s.hc_pre(merge=True),
        lambda s: s.hc_merge(),
    ],
    "attention": [lambda s: s.attention_pre(), lambda s: s.attention_post()],
}


def steps(phase: str, smoke: bool) -> Iterator[tuple[str, GlueStep]]:
    """(label, step) pairs the phase runs on, built one at a time (each holds a KV pool): B = 1
    and 64 around CONTEXT (about a quarter of the rows close a CSA window, one in 128 an HCA
    window), for the compressors also B = 64 with every row closing both; the tiny model's edge
    positions in --smoke."""
    if smoke:
        cfg = model_config("tiny")
        yield "smoke", GlueStep(cfg, SMOKE_POSITIONS, device="cpu", dtype=torch.float32)
        return
    cfg, gen = model_config("v4-flash"), torch.Generator().manual_seed(0)
    rows = [
        (f"B={b}", (CONTEXT + torch.randint(0, 4096, (b,), generator=gen)).tolist())
        for b in BATCHES
    ]
    if phase == "compressor":
        rows.append(("B=64 all close", [CONTEXT + 128 * k - 1 for k in range(1, 65)]))
    for label, positions in rows:
        yield (
            label,
            GlueStep(
                cfg,
                positions,
                device="cuda",
                dtype=torch.bfloat16,
                kv_bytes=2 << 30,
                page_size=64,
                max_position=MAX_CONTEXT,
                seed=len(positions),
            ),
        )


# ---- measurements ----------------------------------------------------------------------------


def time_us(fn: Callable, args: tuple, kwargs: dict) -> tuple[float, str]:
    """Median us per call: CUDA-graph replays of REPEAT calls (eager calls if capture fails)."""
    ms, mode = time_ms_any(lambda: [fn(*args, **kwargs) for _ in range(REPEAT)], [()])
    return 1e3 * ms / REPEAT, mode


def bitwise_equal(op: Op, got: tuple, want: tuple) -> float:
    """Share of the floating-point elements the op produced (outputs and written rows) that
    are bit for bit the reference's."""
    same = total = 0
    for a, b in paired(op, got, want) or []:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            same += int((a == b).sum())
            total += a.numel()
    return same / total if total else 1.0


def measure(
    build: Callable[[GlueStep], Op], step: GlueStep, label: str, smoke: bool, gbps: float
) -> dict:
    """One op: correctness of the Triton path against the torch sequence, then (unless smoke)
    both timed."""
    op = build(step)
    row = {"op": op.name, "batch": label, "floor_bytes": op.floor_bytes, **op.info}
    ref = op.run(op.reference)
    got = op.run(op.fused, "triton")
    row["rel_err"] = compare(op, got, ref)
    row["bitwise_equal"] = bitwise_equal(op, got, ref)
    row["ok"] = row["rel_err"] < 1e-2
    if smoke:
        return row
    args = op.fresh_args()
    with kernels.use_backend("triton"):
        row["fused_us"], row["fused_timing"] = time_us(op.fused, args, op.kwargs)
        row["fused_launches"] = launches(op.fused, args, op.kwargs)
    row["torch_us"], row["torch_timing"] = time_us(op.reference, args, op.kwargs)
    row["torch_launches"] = launches(op.reference, args, op.kwargs)
    row["x_torch"] = row["torch_us"] / row["fused_us"]
    row["floor_us"] = op.floor_bytes / gbps / 1e3
    row["x_floor"] = row["fused_us"] / row["floor_us"]
    return row


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"  {r['op']:<22} ERROR {r['error'][:120]}", flush=True)
        return
    print(
        f"  {r['op']:<22} {r['batch']:<15} closes {fmt(r.get('closing_rows'), '>3')}"
        f" err {r['rel_err']:.1e} bit-eq {100 * r['bitwise_equal']:5.1f}%"
        f" {'ok' if r['ok'] else 'MISMATCH'}"
        f" | torch {fmt(r.get('torch_us'), '7.1f')} us ({fmt(r.get('torch_launches'), '4.1f')} ops)"
        f" fused {fmt(r.get('fused_us'), '6.1f')} us ({fmt(r.get('fused_launches'), '3.1f')} ops)"
        f" x{fmt(r.get('x_torch'), '5.1f')} | floor {fmt(r.get('floor_us'), '5.2f')} us"
        f" x{fmt(r.get('x_floor'), '6.1f')}",
        flush=True,
    )


# ---- phases --------------------------------------------------------------------------------


def run_phase(phase: str, smoke: bool, result: dict, save: Callable[[], None]) -> None:
    gbps = float("nan") if smoke else hardware.measure("cuda").copy_GBps
    result.setdefault("copy_GBps", {})[phase] = gbps
    rows = result.setdefault("rows", [])
    rows[:] = [r for r in rows if r.get("phase") != phase]  # a rerun replaces the phase's rows
    print(f"== {phase}: copy {gbps:.0f} GB/s", flush=True)
    for label, step in steps(phase, smoke):
        for i, build in enumerate(PHASES[phase]):
            r = attempt(f"{phase} op {i} {label}", measure, build, step, label, smoke, gbps)
            if "error" in r:  # (a failed op is still named in the record)
                r = {"op": f"{phase} op {i} {label}", **r}
            r["phase"] = phase
            rows.append(r)
            print_row(r)
            save()
        del step  # this step's KV pool goes before the next one is built
        if not smoke:
            torch.cuda.empty_cache()


def summarize(result: dict) -> None:
    """Per op at B = 64: launches and time before -> after; the sum over one decode step of
    V4-Flash's 43 layers is left to bench/engine.py, which runs the integrated model."""
    print("\nB=64 (torch -> fused):")
    for r in result.get("rows", []):
        if r.get("batch") == "B=64" and "fused_us" in r:
            print(
                f"  {r['op']:<22} {r['torch_launches']:4.1f} -> {r['fused_launches']:3.1f} ops,"
                f" {r['torch_us']:7.1f} -> {r['fused_us']:6.1f} us (x{r['x_torch']:.1f})"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out",
        default=None,
        help=f"JSON to write (merged into if it exists); default {DEFAULT_OUT}, none with --smoke",
    )
    ap.add_argument("--only", choices=sorted(PHASES), help="run one phase in this process")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU smoke: tiny model, Triton interpreter, no timing"
    )
    args = ap.parse_args()
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    if args.only is None:  # each phase in its own process: a CUDA fault stays in its phase
        failed = []
        for phase in PHASES:
            cmd = [sys.executable, "-m", "bench.glue", "--only", phase]
            cmd += (["--out", out] if out else []) + (["--smoke"] if args.smoke else [])
            print(f"== phase {phase}: {' '.join(cmd[1:])}", flush=True)
            rc = subprocess.run(cmd).returncode
            if rc:
                print(f"== phase {phase} FAILED (exit {rc}); going on", flush=True)
                failed.append(phase)
        if out and os.path.exists(out):
            with open(out) as f:
                summarize(json.load(f))
        print(f"== done; failed phases: {failed or 'none'}; JSON: {out}")
        sys.exit(1 if failed else 0)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench.glue needs CUDA (use --smoke on CPU)")
    result = read_record(out)
    if not args.smoke:
        result["hardware"] = prologue(0)
    result["timing"] = (
        f"median us per call over CUDA-graph replays of {REPEAT} back-to-back calls; floors: "
        "bytes that must move / the copy bandwidth measured in the same phase"
    )
    t0 = time.time()

    def save() -> None:  # after each op, so a run cut short keeps what it measured
        result.setdefault("wall_s", {})[args.only] = time.time() - t0
        write_record(out, result)

    run_phase(args.only, args.smoke, result, save)
    bad = [r for r in result["rows"] if r.get("phase") == args.only and not r.get("ok")]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
