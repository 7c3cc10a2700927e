"""KV capacity per GPU: data-parallel attention (DP=4, experts split by expert parallelism)
against tensor parallelism (TP=4), for V4-Flash on H200s, from the pool plans (exact arithmetic,
nothing allocated: runs on a CPU).

    python -m bench.dp_capacity --out bench/results/cpu-dp-capacity.json

V4's single KV head is whole on every rank of a TP group, so a TP=4 group's four pools hold one
set of contexts; four DP engines' pools hold four. Two comparisons:
- the same KV budget per GPU (--budget-gib): tokens of distinct context per GPU;
- the same GPU (--gpu-gib x --gpu-memory-utilization): the weights each rank keeps come first
  (the release's formats: FP8 linears, FP4 routed experts; built on the meta device), so DP's
  replicated attention and shared experts cost it some of the budget that TP splits four ways.
Each engine keeps --max-num-seqs sequences (vLLM's default, per DP engine as per TP group).
"""

from __future__ import annotations

import argparse

import torch

from bench.harness import write_record
from bench.kv_cache_dtype import context_tokens
from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.weights import build_model
from dsaserve.engine.parallel.expert_parallel import ExpertParallel
from dsaserve.engine.parallel.group import TensorParallel

RELEASE_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
V4_FLASH = ModelConfig.from_hf(
    {"model_type": "deepseek_v4", "quantization_config": RELEASE_QUANT, "expert_dtype": "fp4"}
)
HEADROOM = 2 << 30  # activations and graphs (engine.rank's default reserve)


def weight_bytes(tp: TensorParallel) -> int:
    """Bytes of one rank's weights in the release's formats."""
    model = build_model(V4_FLASH, torch.bfloat16, torch.device("meta"), True, tp)
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def per_gpu_tokens(budget: int, engines_per_group: int, args: argparse.Namespace) -> int:
    """Tokens of distinct context per GPU for a group of `args.size` GPUs whose pools (each
    `budget` bytes) belong to `engines_per_group` engines."""
    kv = KVCacheConfig(
        budget, args.page_size, args.max_num_seqs, 8192, staging_bytes=0, kv_cache_dtype="fp8"
    )
    return context_tokens(V4_FLASH, kv, 2) * engines_per_group // args.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4, help="GPUs: DP=size against TP=size")
    parser.add_argument("--budget-gib", type=float, default=60.0)
    parser.add_argument("--gpu-gib", type=float, default=141.0, help="H200: 141 GB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.size
    budget = int(args.budget_gib * 2**30)
    same_budget = {"tp": per_gpu_tokens(budget, 1, args), "dp": per_gpu_tokens(budget, n, args)}
    weights = {
        "tp": weight_bytes(TensorParallel(0, n)),
        "dp": weight_bytes(TensorParallel(0, 1, ep=ExpertParallel(0, n))),
    }
    usable = int(args.gpu_gib * 1e9 * args.gpu_memory_utilization) - HEADROOM
    budgets = {k: usable - w for k, w in weights.items()}
    same_gpu = {
        "tp": per_gpu_tokens(budgets["tp"], 1, args),
        "dp": per_gpu_tokens(budgets["dp"], n, args),
    }
    record = {
        "model": "v4-flash (HF defaults, release formats: FP8 linears, FP4 experts, FP8 KV)",
        "size": n,
        "max_num_seqs": args.max_num_seqs,
        "page_size": args.page_size,
        "same_budget": {"budget_bytes": budget, "tokens_per_gpu": same_budget},
        "same_gpu": {
            "gpu_bytes": int(args.gpu_gib * 1e9),
            "weight_bytes_per_gpu": weights,
            "kv_budget_bytes_per_gpu": budgets,
            "tokens_per_gpu": same_gpu,
        },
        "ratio_same_budget": same_budget["dp"] / same_budget["tp"],
        "ratio_same_gpu": same_gpu["dp"] / same_gpu["tp"],
    }
    print(f"{'':<28}{'TP=' + str(n):>14}{'DP=' + str(n) + '+EP':>14}{'DP/TP':>8}")
    for name, row in (("same KV budget per GPU", same_budget), ("same H200", same_gpu)):
        print(
            f"{name + ', tokens/GPU':<28}{row['tp']:>14,}{row['dp']:>14,}"
            f"{row['dp'] / row['tp']:>8.3f}"
        )
    for k, w in weights.items():
        print(f"weights per GPU ({k}): {w / 2**30:.1f} GiB, KV budget {budgets[k] / 2**30:.1f} GiB")
    write_record(args.out, record)


if __name__ == "__main__":
    main()
