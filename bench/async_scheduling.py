"""Async scheduling against waiting for every step: the engine's decode step as served.

    python -m bench.async_scheduling --device cuda --out bench/results/h200-async-demo.json
    python -m bench.engine --write-slice /tmp/slice --experts 16 --slice-format release
    python -m bench.async_scheduling --device cuda --model /tmp/slice --context 32768 \
        --max-model-len 65536 --floors --out bench/results/h200-async-slice.json
    python -m bench.async_scheduling --context 1024   # CPU: the demo model, times mean little

For each model the whole engine runs (`LLMEngine.step`: scheduling, inputs, CUDA graph replay,
sampling, detokenizing, stop checks), over `--concurrency` requests whose `--context` tokens
are already in the KV cache (engine.profile.history). Decode steps are timed back to back, as a
worker runs them, once waiting for each step's ids before scheduling the next
(--no-async-scheduling) and once with async scheduling, on the same engine and requests.
What async scheduling hides is the host's share of the waited step. With `--floors` the
async step is also set against the sum of its floors (`dsaserve profile`'s report at the same
concurrency and context, printed and kept in the JSON; the c=1 target of issue 10 is <= 1.5x).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import prologue, write_record
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.profile import hardware, history
from dsaserve.engine.profile.capture import sync
from dsaserve.engine.profile.decode import profile_engine, steps_run
from dsaserve.engine.profile.report import format_table

WARMUP = 3


def steps_per_s(engine: LLMEngine, steps: int) -> float:
    """Decode steps per second, `steps` back to back after a warm-up (the requests decode)."""
    for _ in range(WARMUP):
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    return steps / (time.perf_counter() - t0)


def measure(engine: LLMEngine, concurrency: int, context: int, steps: int, floors: bool) -> dict:
    need = 2 * (WARMUP + steps) + (steps_run(3) if floors else 0)
    ids = history.add_decoding_requests(engine, concurrency, context, need)
    row: dict = {"concurrency": concurrency, "context": context}
    try:
        for mode, on in (("waited", False), ("async", True)):
            engine.async_scheduling = on
            rate = steps_per_s(engine, steps)
            row[f"{mode}_step_ms"], row[f"{mode}_tok_s"] = 1e3 / rate, concurrency * rate
        row["async_speedup"] = row["waited_step_ms"] / row["async_step_ms"]
    finally:
        history.finish(engine, ids)
        while engine.has_unfinished():  # the aborted requests' last rows
            engine.step()
    if floors:
        hw = hardware.known(torch.cuda.get_device_name()) or hardware.measure(engine.device)
        engine.async_scheduling = True
        report = profile_engine(
            engine, concurrency=concurrency, context=context, steps=3, hardware=hw
        ).as_dict()
        row["floor_ms"] = report["floor_ms"]
        row["async_step_over_floor"] = row["async_step_ms"] / report["floor_ms"]
        print(format_table(report), flush=True)
        row["profile"] = report
    print({k: v for k, v in row.items() if k != "profile"}, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="model dir, or 'demo' (default: demo)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=None, help="(default: the model's)")
    p.add_argument("--floors", action="store_true", help="also the async step against floors")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    result: dict = {
        **prologue(args.device),
        "context": args.context,
        "models": {},
    }
    for model in args.model or ["demo"]:
        path = DEMO_MODEL_DIR if model == "demo" else model
        config = EngineConfig(
            device=args.device,
            dtype="bfloat16" if cuda else "float32",
            max_num_seqs=max(args.concurrency),
            max_model_len=args.max_model_len,
        )
        engine = LLMEngine(path, config)
        try:
            rows = [
                measure(engine, n, args.context, args.steps if cuda else 5, args.floors and cuda)
                for n in args.concurrency
            ]
        finally:
            engine.close()
        result["models"][model] = rows
        del engine
        if cuda:
            torch.cuda.empty_cache()
    print_table(result)
    write_record(args.out, result, indent=2)


def print_table(result: dict) -> None:
    print(f"\n{result['device']}, context {result['context']}")
    print(
        f"{'model':28s} {'conc':>4s} {'waited ms':>10s} {'async ms':>9s} {'speed-up':>9s} "
        f"{'tok/s async':>12s} {'x floor':>8s}"
    )
    for model, rows in result["models"].items():
        for r in rows:
            over = r.get("async_step_over_floor")
            print(
                f"{model[-28:]:28s} {r['concurrency']:4d} {r['waited_step_ms']:10.3f} "
                f"{r['async_step_ms']:9.3f} {r['async_speedup']:9.2f} {r['async_tok_s']:12.1f} "
                f"{'-' if over is None else f'{over:.2f}':>8s}"
            )


if __name__ == "__main__":
    main()
