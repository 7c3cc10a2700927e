"""Prefix caching: time to first token and prefill tokens/s with and without a cached prefix, on
the same engine in one run.

    python -m bench.prefix_cache --out bench/results/cpu-prefix-cache.json   # CPU, demo model
    python -m bench.prefix_cache --device cuda --slice --prompt-tokens 32768 --extend-tokens 3277 \
        --out bench/results/h200-prefix-cache.json     # V4-Flash-width slice, 90% of 32K cached

Each repetition draws fresh random prompts, so nothing is cached by accident:
- `first`: a prompt of --prompt-tokens that nothing shares (computed from its first token, its
  checkpoints taken on the way);
- `extends`: that prompt plus --extend-tokens more (the next turn of a conversation): it resumes
  at the end of the first;
- `fresh`: a prompt as long as `extends` that nothing shares: what `extends` costs without the
  cache, on the same engine.
`extends / fresh` is the TTFT the cache saves; the prefill tokens/s of `extends` counts only the
tokens it computed (the uncached part), to set against `fresh`'s. With --compare-engine the run
also times `fresh` on a second engine built with --no-enable-prefix-caching, so the cost of taking
checkpoints shows (the demo model on CPU only: two slices may not fit one GPU).

TTFT here is the engine's: from `add_request` to the step output that carries the first token,
stepping the engine as a worker does (async scheduling on), one request at a time.
`--slice` runs bench/engine.py's V4-Flash-width slice (random weights, --experts experts) in
bf16, as the GPU target asks; with --device cpu, its smoke widths in fp32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench.harness import fmt, prologue, write_record
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
SCENARIOS = ("first", "extends", "fresh")


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding `prompt` to its first token, and the tokens it found cached."""
    engine.add_request(rid, prompt, FIRST_TOKEN)
    start = time.perf_counter()
    while True:
        out = next((o for o in engine.step() if o.request_id == rid), None)
        if out is not None:
            seconds = time.perf_counter() - start
            break
    while engine.has_unfinished():
        engine.step()
    return seconds, out.cached_tokens


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def measure(engine: LLMEngine, args: argparse.Namespace, seed: int) -> dict[str, tuple[float, int]]:
    vocab = engine.tokenizer.vocab_size
    first = prompt(args.prompt_tokens, vocab, seed)
    extends = first + prompt(args.extend_tokens, vocab, seed + 1)
    fresh = prompt(len(extends), vocab, seed + 2)
    return {
        "first": ttft(engine, f"first-{seed}", first),
        "extends": ttft(engine, f"extends-{seed}", extends),
        "fresh": ttft(engine, f"fresh-{seed}", fresh),
    }


def run(engine: LLMEngine, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median TTFT (ms), cached tokens and prefill tok/s of the computed part per scenario."""
    measure(engine, args, seed=10_000)  # warm-up: lazy initialisation, autotuning
    reps = [measure(engine, args, seed=3 * r) for r in range(args.reps)]
    total = {"first": args.prompt_tokens, "extends": args.prompt_tokens + args.extend_tokens}
    total["fresh"] = total["extends"]
    out = {}
    for name in SCENARIOS:
        seconds = statistics.median(r[name][0] for r in reps)
        cached = statistics.median(r[name][1] for r in reps)
        out[name] = {
            "ttft_ms": 1e3 * seconds,
            "cached_tokens": cached,
            "prefill_tok_s": (total[name] - cached) / seconds,
        }
    return out


def build(model: str, args: argparse.Namespace, caching: bool) -> LLMEngine:
    cuda = args.device.startswith("cuda")
    return LLMEngine(
        model,
        EngineConfig(
            device=args.device,
            dtype="bfloat16" if cuda else "float32",
            max_num_seqs=4,
            max_model_len=args.prompt_tokens + 2 * args.extend_tokens + 16,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=caching,
        ),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the demo model)")
    p.add_argument("--slice", action="store_true", help="bench/engine.py's V4-Flash-width slice")
    p.add_argument("--experts", type=int, default=16, help="with --slice: routed experts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--extend-tokens", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument(
        "--compare-engine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time `fresh` on an engine without the cache (default: on CPU only)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(DEMO_MODEL_DIR)
        if args.slice:
            from bench.engine import write_slice

            model = str(write_slice(tmp, args.experts, smoke=not cuda))
        result: dict = {
            **prologue(args.device),
            "model": "v4-flash-width slice" if args.slice else os.path.basename(model),
            "prompt_tokens": args.prompt_tokens,
            "extend_tokens": args.extend_tokens,
            "reps": args.reps,
        }
        engine = build(model, args, caching=True)
        try:
            result["cached_engine"] = run(engine, args)
            result["checkpoint_interval"] = engine.config.prefix_cache_checkpoint_interval
        finally:
            engine.close()
        del engine
        if args.compare_engine if args.compare_engine is not None else not cuda:
            plain = build(model, args, caching=False)
            try:
                result["uncached_engine"] = run(plain, args)
            finally:
                plain.close()
    summarize(result)
    print_table(result)
    write_record(args.out, result, indent=2)


def summarize(result: dict) -> None:
    cached = result["cached_engine"]
    result["extends_over_first_ttft"] = cached["extends"]["ttft_ms"] / cached["first"]["ttft_ms"]
    result["extends_over_fresh_ttft"] = cached["extends"]["ttft_ms"] / cached["fresh"]["ttft_ms"]
    result["uncached_part_over_fresh_tok_s"] = (
        cached["extends"]["prefill_tok_s"] / cached["fresh"]["prefill_tok_s"]
    )
    if "uncached_engine" in result:
        plain = result["uncached_engine"]["fresh"]
        result["checkpoint_cost"] = cached["fresh"]["ttft_ms"] / plain["ttft_ms"] - 1


def print_table(result: dict) -> None:
    print(
        f"\n{result['device']}, {result['model']}: {result['prompt_tokens']} + "
        f"{result['extend_tokens']} tokens, median of {result['reps']}"
    )
    print(f"{'engine':10s} {'scenario':9s} {'TTFT ms':>9s} {'cached':>7s} {'prefill tok/s':>14s}")
    for engine in ("cached_engine", "uncached_engine"):
        for name, row in result.get(engine, {}).items():
            print(
                f"{engine.split('_')[0]:10s} {name:9s} {fmt(row['ttft_ms'], '9.1f')} "
                f"{row['cached_tokens']:7.0f} {fmt(row['prefill_tok_s'], '14.0f')}"
            )
    print(
        f"extends / first TTFT {result['extends_over_first_ttft']:.3f}, extends / fresh "
        f"{result['extends_over_fresh_ttft']:.3f}; uncached part's tok/s / fresh's "
        f"{result['uncached_part_over_fresh_tok_s']:.3f}"
        + (
            f"; checkpoints cost {100 * result['checkpoint_cost']:+.1f}% of fresh TTFT"
            if "checkpoint_cost" in result
            else ""
        )
    )


if __name__ == "__main__":
    main()
