"""--kv-cache-dtype fp8 against the model-dtype cache: how many more tokens a budget holds, and
what the FP8 pages do to the demo model's logits.

    python -m bench.kv_cache_dtype --out bench/results/cpu-kv-cache-dtype.json       # CPU
    python -m bench.kv_cache_dtype --device cuda --out bench/results/h200-kv-cache-dtype.json

Capacity is exact arithmetic on the pool plans (engine.kv.pool.plan_pages, nothing allocated):
bytes one more token of context costs (every layer past its window: bytes_per_token), and the
tokens of context the pools hold at a budget, for the built-in demo model, V4-Flash and
DeepSeek-V3.2 (HF's defaults), FP8 against bf16 (and against fp32, the CPU's default --dtype).

Numerics run the demo model (engine/assets/dsaserve-demo-v4; trained, so its logits mean
something) with the two caches, everything else equal (on the CPU also bf16 against fp32
arithmetic with the model-dtype cache, as a yardstick): each prompt alone (prefill in chunks,
then greedy decode steps, every step's logits captured), then teacher-forced scoring of the
auto cache's greedy continuations with the FP8 cache (its argmax given the same prefix: no
cascade after a first near-tie flips one token), and bits per byte on held-out text. Prompts
are 200 bytes and longer, past the 128-token window, so compressed entries and the indexer's
top-k (32 of > 50 CSA entries) are read from the FP8 pages.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench.harness import prologue, write_record
from bench.numerics import BOS, bits_per_byte, greedy_agreement, heldout_windows
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import (
    KVCacheConfig,
    KVModel,
    bytes_per_token,
    plan_pages,
    staging_block_bytes,
)
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.config import ModelConfig as V32Config
from dsaserve.engine.sampling_params import SamplingParams

V4_FLASH = ModelConfig.from_hf({"model_type": "deepseek_v4"})  # HF's defaults: V4-Flash
V32 = V32Config.from_hf({"model_type": "deepseek_v32"})  # HF's defaults: the release's 61 layers
DEMO = ModelConfig.from_dir(DEMO_MODEL_DIR)
MODELS = (("demo", DEMO), ("v4-flash", V4_FLASH), ("v3.2", V32))
# (model, budget, max_num_seqs, max_num_batched_tokens): the e2e tests' demo workers, a
# V4-Flash worker with most of an H200 left after the weights, and a rank of a V3.2 worker on 8
# H200s (86 GB of FP8 weights each; the latent rows whole on every rank)
BUDGETS = [
    ("demo", DEMO, 64 << 20, 32, 1024),
    ("v4-flash", V4_FLASH, 60 << 30, 256, 8192),
    ("v3.2", V32, 40 << 30, 256, 8192),
]
PAGE = 64


def context_tokens(cfg: KVModel, kv: KVCacheConfig, esize: int) -> int:
    """Tokens of context (past every request's fixed window) the planned pages hold, counted in
    the first group with index keys (V4: CSA; V3.2: its one group), else the first compressed
    one (HCA); staging left out (staging_bytes=0)."""
    fp8 = kv.kv_cache_dtype == "fp8"
    pages, _ = plan_pages(cfg, kv, esize, staging_block_bytes(cfg, kv.page_size, esize, fp8))
    groups = cfg.kv_groups()
    group = next((g for g in groups if g.indexed), None) or next(g for g in groups if g.ratio)
    ring_pages = math.ceil(cfg.sliding_window / kv.page_size)
    base = kv.max_num_seqs * (ring_pages + 1)
    return (pages[group.name] - base) * kv.page_size * group.ratio


def capacity() -> dict:
    out = {}
    for name, cfg in MODELS:
        bf16, fp32, fp8 = (
            bytes_per_token(cfg, e, f) for e, f in ((2, False), (4, False), (2, True))
        )
        out[name] = {
            "bytes_per_token": {"bfloat16": bf16, "float32": fp32, "fp8": fp8},
            "ratio_vs_bfloat16": bf16 / fp8,
            "ratio_vs_float32": fp32 / fp8,
        }
    for name, cfg, budget, seqs, batched in BUDGETS:
        kv = {
            d: KVCacheConfig(budget, PAGE, seqs, batched, staging_bytes=0, kv_cache_dtype=d)
            for d in ("auto", "fp8")
        }
        tokens = {
            "bfloat16": context_tokens(cfg, kv["auto"], 2),
            "float32": context_tokens(cfg, kv["auto"], 4),
            "fp8": context_tokens(cfg, kv["fp8"], 2),
        }
        out[name]["at_budget"] = {
            "budget_bytes": budget,
            "max_num_seqs": seqs,
            "max_num_batched_tokens": batched,
            "page_size": PAGE,
            "context_tokens": tokens,
            "ratio_vs_bfloat16": tokens["fp8"] / tokens["bfloat16"],
            "ratio_vs_float32": tokens["fp8"] / tokens["float32"],
        }
    return out


def llm(kv_cache_dtype: str, dtype: str, device: str) -> LLM:
    return LLM(
        DEMO_MODEL_DIR,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=4,
        max_num_batched_tokens=96,  # prompts prefill in several chunks
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
    )


def step_logits(model: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of one prompt and the logits of every step that sampled [steps, V]."""
    runner, seen = model.engine.runner, []
    forward = runner.forward

    def capture(spans, num_decode, logit_rows):
        logits = forward(spans, num_decode, logit_rows)
        seen.append(logits.float().cpu())
        return logits

    runner.forward = capture
    try:
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        [result] = model.generate([prompt], params)
    finally:
        runner.forward = forward
    return result.token_ids, torch.cat([s for s in seen if s.shape[0]])


def compare(ref: LLM, test: LLM, prompts: int, steps: int, windows: int) -> dict:
    """How far `test`'s logits and tokens lie from `ref`'s on the demo model's held-out text."""
    starts = [[BOS, *w[: 200 + 24 * i]] for i, w in enumerate(heldout_windows(prompts, 512))]
    tokens: dict[str, list[list[int]]] = {"ref": [], "test": []}
    max_abs, sum_abs, count, ref_scale, steps_compared = 0.0, 0.0, 0, 0.0, 0
    for prompt in starts:
        r_tokens, r_logits = step_logits(ref, prompt, steps)
        t_tokens, t_logits = step_logits(test, prompt, steps)
        tokens["ref"].append(r_tokens)
        tokens["test"].append(t_tokens)
        # Step i's logits are comparable while both continuations agree on tokens < i.
        pairs = enumerate(zip(r_tokens, t_tokens, strict=True))
        n = min(next((i for i, (x, y) in pairs if x != y), steps) + 1, steps)
        diff = (t_logits[:n] - r_logits[:n]).abs()
        max_abs = max(max_abs, diff.max().item())
        sum_abs += diff.sum().item()
        count += diff.numel()
        steps_compared += n
        ref_scale = max(ref_scale, r_logits[:n].std(dim=-1).max().item())
    forced_same = forced_total = 0
    for prompt, seq in zip(starts, tokens["ref"], strict=True):
        logits = test.score([*prompt, *seq[:-1]]).float().cpu()[len(prompt) - 1 :]
        forced_same += int((logits.argmax(dim=-1) == torch.tensor(seq)).sum())
        forced_total += len(seq)
    texts = heldout_windows(windows)
    bpb = {"ref": bits_per_byte(ref.score, texts), "test": bits_per_byte(test.score, texts)}
    return {
        "prompts": prompts,
        "prompt_tokens": [len(p) for p in starts],
        "steps": steps,
        "decode_logits": {
            "steps_compared": steps_compared,
            "max_abs_diff": max_abs,
            "mean_abs_diff": sum_abs / count,
            "largest_logit_std": ref_scale,
        },
        "greedy_agreement": greedy_agreement(tokens["test"], tokens["ref"]),
        "first_divergence": [
            next((i for i, (x, y) in enumerate(zip(r, t, strict=True)) if x != y), steps)
            for r, t in zip(tokens["ref"], tokens["test"], strict=True)
        ],
        "teacher_forced_agreement": forced_same / forced_total,
        "bits_per_byte": {**bpb, "windows": windows, "rel_diff": bpb["test"] / bpb["ref"] - 1},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t = time.perf_counter()
    dtypes = ["float32", "bfloat16"] if args.device == "cpu" else ["bfloat16"]
    runs = {(d, c): llm(c, d, args.device) for d in dtypes for c in ("auto", "fp8")}
    sizes = (args.prompts, args.steps, args.windows)
    numerics = {  # "test against ref": the FP8 cache against the model-dtype cache
        f"{d} fp8 against {d} auto": compare(runs[d, "auto"], runs[d, "fp8"], *sizes)
        for d in dtypes
    }
    if len(dtypes) == 2:  # a yardstick: what bf16 arithmetic alone does to the same numbers
        numerics["bfloat16 auto against float32 auto"] = compare(
            runs["float32", "auto"], runs["bfloat16", "auto"], *sizes
        )
    result = {
        **prologue(args.device),
        "capacity": capacity(),
        "numerics": numerics,
        "seconds": round(time.perf_counter() - t, 1),
    }
    print(json.dumps(result, indent=1))
    write_record(args.out, result)


if __name__ == "__main__":
    main()
