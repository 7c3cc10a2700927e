"""The sampler's cost per decode step at V4's vocabulary (129280), by kind of request.

    python -m bench.sampler --device cuda --out bench/results/h200-sampler.json

Each row times `engine.sampler.sample` on [B, 129280] fp32 logits, CUDA-event timed and
synchronized per call (as a step uses it, with its small host-to-device copies). Greedy is
one argmax; temperature-only rows race over the vocabulary as it is; top-k / top-p rows sort
it first, the cost every sampled row paid before the two were told apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.harness import prologue, write_record
from dsaserve.engine.sampler import sample
from dsaserve.engine.sampling_params import SamplingParams

VOCAB = 129280
KINDS = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.7),
    "temperature, seeded": SamplingParams(temperature=0.7, seed=1),
    "top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
}


def time_us(logits: torch.Tensor, params: SamplingParams, reps: int) -> float:
    rows = logits.shape[0]
    for _ in range(3):
        sample(logits, [params] * rows, [0] * rows)
    times = []
    for i in range(reps):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sample(logits, [params] * rows, [i] * rows)
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    result = {**prologue(dev), "rows": []}
    print(f"{'kind':22s} {'B':>4s} {'us':>9s}")
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device=dev, generator=torch.Generator(dev).manual_seed(0))
        for kind, params in KINDS.items():
            us = time_us(logits, params, args.reps)
            result["rows"].append({"kind": kind, "batch": rows, "us": us})
            print(f"{kind:22s} {rows:4d} {us:9.1f}", flush=True)
    write_record(args.out, result, indent=2)


if __name__ == "__main__":
    main()
