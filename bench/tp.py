"""Tensor parallelism's effect on the engine's decode step: the V4-Flash-width slice of
bench/engine.py at TP=1 on one GPU and at TP=N on N GPUs of one host, in one run, in bf16 and
with the release's weight formats (FP8 linears, FP4 experts).

    NCCL_NVLS_ENABLE=0 python -m bench.tp --experts 256 -tp 2 --out bench/results/h200x2-tp.json
    python -m bench.tp --smoke                  # CPU over gloo, tiny widths: every phase runs

Each configuration decodes requests with a synthetic KV history through the engine's own
scheduler, runner (CUDA graphs on every rank), sampler and, at TP=N, the channel that carries
each step to the other ranks: the step a server takes. The result is step(TP=N) / step(TP=1) at
the same concurrency and context. For N=2 at c=64 the target is <= 0.6: the routed experts,
most of the bytes a step reads, split in two; the replicated parts (indexer, compressors, mHC,
shared expert, wkv, wq_a) and the all-reduces do not.
"""

from __future__ import annotations

import argparse
import gc
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.engine import Bench, release_model, slice_config
from bench.harness import write_record
from dsaserve.engine.parallel.channel import Channel
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.parallel.launch import Followers, World, join_follower
from dsaserve.engine.rank import serve

PHASES = ("bf16", "release")


@dataclass(frozen=True)
class Plan:
    experts: int
    steps: int
    smoke: bool

    @property
    def concurrency(self) -> tuple[int, ...]:
        return (1, 4) if self.smoke else (1, 64)

    @property
    def contexts(self) -> tuple[int, ...]:
        return (64,) if self.smoke else (4096, 32768)

    def device(self, rank: int) -> torch.device:
        return torch.device("cpu") if self.smoke else torch.device("cuda", rank)


def phases(
    plan: Plan, rank: int, tp: TensorParallel, channel: Channel | None
) -> Iterator[tuple[str, Bench]]:
    """The benches every rank builds, in the same order (their graph captures meet)."""
    bench = Bench(
        slice_config(plan.experts, plan.smoke),
        max_seqs=72,
        kv_bytes=(64 << 20) if plan.smoke else 8 << 30,
        dev=plan.device(rank),
        tp=tp,
        channel=channel,
    )
    yield "bf16", bench
    bench.use(release_model(bench.model))
    yield "release", bench


def measure(plan: Plan, bench: Bench) -> list[dict]:
    rows = []
    for context in plan.contexts:
        for n in plan.concurrency:
            tok_s, step_ms = bench.decode_tokens_per_s(n, context, plan.steps)
            rows.append({"concurrency": n, "context": context, "tok_s": tok_s, "step_ms": step_ms})
            print(rows[-1], flush=True)
    return rows


def run_group(plan: Plan, size: int) -> dict[str, list[dict]]:
    """Rank 0 of a group of `size`: build and measure every phase; the others follow."""
    if size == 1:
        return {name: measure(plan, bench) for name, bench in phases(plan, 0, SINGLE, None)}
    group = Followers(World(tensor_parallel_size=size), plan.device(0), follower, plan)
    out = {}
    try:
        for name, bench in phases(plan, 0, group.tp, group.channel):
            out[name] = measure(plan, bench)
            if name != PHASES[-1]:
                group.channel.send(None)  # the followers go on to the next phase
    finally:
        group.close()  # (its None ends the last phase)
    return out


def follower(plan: Plan, rank: int, world: World) -> None:
    tp, channel = join_follower(rank, world, plan.device(rank))
    for _, bench in phases(plan, rank, tp, None):
        serve(bench.runner, channel)
    dist.destroy_process_group()


def ratios(result: dict, size: int) -> dict[str, float]:
    """step(TP=size) / step(TP=1), by phase, concurrency and context."""
    out = {}
    for phase in PHASES:
        base = {
            (r["concurrency"], r["context"]): r["step_ms"] for r in result["tp1"].get(phase, [])
        }
        for r in result[f"tp{size}"].get(phase, []):
            key = (r["concurrency"], r["context"])
            if key in base:
                out[f"{phase}_c{key[0]}_ctx{key[1]}"] = r["step_ms"] / base[key]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny widths; times mean nothing")
    args = parser.parse_args()
    size = args.tensor_parallel_size
    plan = Plan(
        experts=16 if args.smoke else args.experts,
        steps=2 if args.smoke else args.steps,
        smoke=args.smoke,
    )
    result: dict = {"config": {"experts": plan.experts, "tensor_parallel_size": size}, "errors": {}}
    for n in (1, size):
        try:
            result[f"tp{n}"] = run_group(plan, n)
        except Exception:
            result["errors"][f"tp{n}"] = traceback.format_exc()
            print(result["errors"][f"tp{n}"], flush=True)
            result[f"tp{n}"] = {}
        gc.collect()  # TP=1's slice leaves GPU 0 before rank 0 of TP=N builds its shard
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["step_ratio"] = ratios(result, size)
    write_record(args.out, result, indent=2)
    print(f"\nstep(TP={size}) / step(TP=1), by phase, concurrency, context (target c64 <= 0.6):")
    for key, ratio in result["step_ratio"].items():
        print(f"  {key:28s} {ratio:.3f}")
    print(f"failed: {sorted(result['errors']) or 'none'}")


if __name__ == "__main__":
    main()
