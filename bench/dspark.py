"""DSpark's time per output token against no speculation, at concurrency 1 and 64 (issue 36's GPU
targets), on a V4-Flash-width slice in the release's formats with a DSpark head.

    python -m bench.dspark --out bench/results/h200-dspark.json              # a GPU
    python -m bench.dspark --smoke                                           # a CPU, tiny widths

The slice's weights are random, so its drafts are never accepted: what a step costs is measured
(a decode step without speculation; a speculating step: the target over 1 + gamma rows per
request, the draft layers' context writes and one block pass), and what it yields is a
mean acceptance length AL given on the command line (--accept-lengths: the demo head's measured
one, DeepSeek's V4.1 golden AL 3.51): time per output token = speculating step / AL against the
decode step, and the target "DSpark <= 0.5x without at c=1" reads off its row. Confidence
scheduling at c=64 needs a trained confidence head to mean anything; the row "whole block" is
its upper bound on cost (the scheduler only ever verifies fewer rows). Requests are written
straight into the KV cache at --context tokens (engine.profile.history), as `dsaserve profile`
does.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.flash_widths import FLASH_WIDTHS
from bench.harness import write_record
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model
from dsaserve.engine.profile import history

SLICE = {
    **FLASH_WIDTHS,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "num_hidden_layers": 4,
    "n_routed_experts": 16,
    "max_position_embeddings": 16384,
}  # fmt: skip


def write_model(out: str, smoke: bool) -> str:
    """The slice (or, --smoke, the tiny release model) with a DSpark head of V4-Flash-0731's
    layout: 3 sliding-window draft layers, blocks of 5."""
    if smoke:
        return str(make_tiny_model(out, fmt="release", draft="dspark"))
    n = SLICE["num_hidden_layers"]
    taps = {"dspark_target_layer_ids": list(range(n - 3, n))}
    return str(make_tiny_model(out, fmt="release", draft="dspark", overrides={**SLICE, **taps}))


def step_seconds(model: str, spec: dict | None, concurrency: int, context: int, steps: int,
                 device: str) -> float:  # fmt: skip
    """Mean seconds of a step of `concurrency` requests at `context` tokens (after warm-up)."""
    engine = LLMEngine(
        model,
        EngineConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32",
                     max_num_seqs=max(concurrency, 2), max_num_batched_tokens=max(
                         512, concurrency * 6), enable_prefix_caching=False,
                     speculative_config=json.dumps(spec) if spec else None),
    )  # fmt: skip
    ids = history.add_decoding_requests(engine, concurrency, context, 2 * steps + 4)
    for _ in range(2):
        engine.step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    history.finish(engine, ids)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model on a CPU")
    p.add_argument("--model-dir", default="/tmp/dsaserve-dspark-slice")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--accept-lengths", type=float, nargs="+", default=[2.8, 3.51])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.concurrency, args.context, args.steps = [1, 4], 64, 3
    model = write_model(args.model_dir, args.smoke)
    spec = {"method": "dspark", "num_speculative_tokens": args.gamma}
    rows = {}
    for c in args.concurrency:
        plain = step_seconds(model, None, c, args.context, args.steps, device)
        spec_step = step_seconds(model, spec, c, args.context, args.steps, device)
        rows[f"c={c}"] = {
            "decode_step_ms": round(plain * 1e3, 3),
            "dspark_step_ms": round(spec_step * 1e3, 3),
            "tpot_vs_none": {
                str(al): round(spec_step / al / plain, 3) for al in args.accept_lengths
            },
        }
        ratios = rows[f"c={c}"]["tpot_vs_none"]
        print(f"c={c}: decode {plain * 1e3:.2f} ms, DSpark step {spec_step * 1e3:.2f} ms; "
              f"TPOT vs none by acceptance length: {ratios}")  # fmt: skip
    write_record(args.out, {"bench": "dspark", "device": device, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
