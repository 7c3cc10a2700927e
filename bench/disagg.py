"""The disaggregated stack on two GPUs against the same stack on one, under a serving load.

    python -m bench.disagg --out-dir bench/results/h200x2-disagg      # two GPUs
    python -m bench.disagg --smoke --out-dir /tmp/disagg              # CPU, tiny model

Writes a random V4-Flash-width slice checkpoint (hidden 4096, 64 heads of 512, every layer kind,
16 experts; the byte tokenizer, so the vocabulary is small), then for each placement starts
redis-server, a prefill worker, a decode worker and the router (loadtest/soak.py's LocalStack)
and runs loadtest/bench_serving.py at each request rate: random prompts of 1K-8K tokens and
256-1K output tokens (vLLM's random range ratio). Placements:

  disagg     prefill on GPU 0, decode on GPU 1: the KV moves over NVLink (UCX cuda_ipc)
  colocated  both workers on GPU 0: prefill chunks and decode steps share one GPU

Per rate: TTFT, ITL and E2E percentiles, output tokens/s, and goodput under an SLO
(TTFT <= 2 s and mean ITL <= 50 ms per request, as DistServe defines it). Writes one JSON and
PNG plots of TTFT and ITL against the rate into --out-dir.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.flash_widths import FLASH_WIDTHS
from bench.harness import write_record
from loadtest.bench_serving import BenchConfig, run_benchmark
from loadtest.report import plot_series
from loadtest.soak import LocalStack

REPO = Path(__file__).resolve().parents[1]

SLO_TTFT_S, SLO_ITL_S = 2.0, 0.050
# A V4-Flash-width slice: the real model's per-layer shapes, fewer layers and experts.
FLASH_SLICE = {
    **FLASH_WIDTHS,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "num_hidden_layers": 4,
    "n_routed_experts": 16,
    "max_position_embeddings": 16384,
}


def goodput(result: dict[str, Any], slo_ttft_s: float, slo_itl_s: float) -> float:
    """Requests per second that met the SLO (TTFT, and the mean gap between their tokens)."""
    good = 0
    for r in result["requests"]:
        if r["error"] or r["ttft"] is None or r["ttft"] > slo_ttft_s:
            continue
        if r["itl"] and sum(r["itl"]) / len(r["itl"]) > slo_itl_s:
            continue
        good += 1
    return good / result["summary"]["duration_s"]


def serve_and_measure(
    placement: str,
    model: Path,
    rates: list[float],
    load: dict[str, Any],
    engine_flags: list[str],
    role_env: dict[str, dict[str, str]],
    log_dir: Path,
) -> list[dict[str, Any]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(str(model), log_dir, engine_flags, lease_s=60.0, role_env=role_env)
    runs = []
    try:
        started = time.monotonic()
        stack.start(timeout_s=600)
        print(f"{placement}: stack healthy in {time.monotonic() - started:.0f} s", flush=True)
        for rate in rates:
            cfg = BenchConfig(
                base_url=stack.url,
                request_rate=rate,
                label=f"{placement} {rate:g} req/s",
                save_details=True,
                **load,
            )
            result = run_benchmark(cfg)
            result["summary"]["goodput"] = goodput(result, SLO_TTFT_S, SLO_ITL_S)
            result["placement"] = placement
            s = result["summary"]
            print(
                f"{placement:9s} rate {rate:5g}: ok {s['completed']:3d} failed {s['failed']:2d} "
                f"TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms  "
                f"ITL p50/p99 {s['itl_ms']['p50']:.1f}/{s['itl_ms']['p99']:.1f} ms  "
                f"out {s['output_throughput']:.0f} tok/s  goodput {s['goodput']:.2f} req/s",
                flush=True,
            )
            runs.append(result)
    finally:
        stack.stop()
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma-separated")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--placements", default="disagg,colocated")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, tiny lengths")
    a = p.parse_args(argv)
    from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in a.rates.split(",")]
    if a.smoke:
        model = make_tiny_model(out / "model" / "dsaserve-tiny-v4")
        engine = ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16"]
        load = {"input_len": 64, "output_len": 8, "range_ratio": 0.5}
        gpus = {"disagg": ({}, {}), "colocated": ({}, {})}
    else:
        started = time.monotonic()
        model = make_tiny_model(out / "model" / "v4-flash-slice", overrides=FLASH_SLICE)
        print(f"model written in {time.monotonic() - started:.0f} s", flush=True)
        engine = ["--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "64"]
        engine += ["--gpu-memory-utilization", "0.45"]  # colocated: two workers share a GPU
        load = {"input_len": 8192, "output_len": 1024, "range_ratio": 0.75}
        gpus = {
            "disagg": ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}),
            "colocated": ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}),
        }
    load["num_prompts"] = a.num_prompts
    results = []
    for placement in a.placements.split(","):
        prefill_env, decode_env = gpus[placement]
        results += serve_and_measure(
            placement,
            model,
            rates,
            load,
            engine,
            {"prefill": prefill_env, "decode": decode_env},
            out / "logs" / placement,
        )
    for r in results:
        r.pop("requests")  # per-request timings: large, and summarized already
    write_record(out / "disagg.json", results)
    for metric in ("ttft_ms", "itl_ms"):
        plot_series(results, metric, out / f"{metric.split('_')[0]}.png", by="placement")
    print(f"wrote {out / 'disagg.json'} and plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
