"""A full-depth DeepSeek-V4-Flash on one GPU in the release's formats (issue 38, item 3).

    python -m bench.full_depth --out bench/results/h200-full-depth.json
    python -m bench.full_depth --smoke          # CPU: tiny widths, 4 layers, same code

All of V4-Flash's layers at its widths (the engine's V4-Flash config, HF's defaults: 43 layers,
23 HCA and 20 CSA, 3 hash-routed, vocab 129280), random weights written straight in the
release's formats (FP8 e4m3 linears with ue8m0 128x128 block scales, FP4 routed experts with
ue8m0 per 32, the rest bf16/fp32 as the release stores them): a bf16 copy to quantize from
would not fit. Routed experts: as many per layer as fit the card beside the KV cache, at most
128 (one EP2 rank's share of 256; --experts N fixes it). A decode step reads only the experts
its tokens pick, so c=1 costs what the whole model's does; at c >= 16 a full model's step
touches more distinct experts than these (the floors count the ones hit).

Measured, requests at 8K context decoding with the engine's scheduler, runner (CUDA graphs for
1, 16, 64, 256 rows) and sampler: time per output token at c=1 and output tokens/s at c=1,
16, 64, 256; `dsaserve profile`'s report of a step at c=1 and c=64 (by kernel class and model
part, the step against the sum of its floors; copy and matmul rates measured in this run).
Not run here: the MTP layer (speculative decoding runs in LLMEngine, not in this harness).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import traceback
from typing import Any

import torch

# (first: before triton is imported, on a CPU it turns Triton's interpreter on)
from dsaserve.kernels import env  # noqa: F401

# isort: split
from bench.engine import RELEASE_QUANTIZATION, SMOKE_WIDTHS, V4, Bench, family, fill_random
from bench.harness import prologue, write_record
from dsaserve.engine.kv.layout import (
    KVBudgetError,
    KVCacheConfig,
    bytes_per_token,
    plan_pages,
    ring_pages,
    staging_block_bytes,
)
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.profile import hardware
from dsaserve.engine.profile.decode import profile_decode
from dsaserve.engine.profile.report import format_table

CONTEXT, SMOKE_CONTEXT = 8192, 64
CONCURRENCY, SMOKE_CONCURRENCY = (1, 16, 64, 256), (1, 4)
MAX_EXPERTS = 128
PAGE = 64  # bench.engine.Bench's page size
MARGIN_BYTES = 8 << 30  # graphs' pools, activations, the profiler, the sampler
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # random codes


def full_config(experts: int, smoke: bool) -> ModelConfig:
    """V4-Flash (HF's defaults) with `experts` routed experts per layer, no MTP layer, in the
    release's formats; smoke: tiny widths and 4 layers."""
    raw = {"model_type": V4, "n_routed_experts": experts, "num_nextn_predict_layers": 0}
    if smoke:
        raw |= {**SMOKE_WIDTHS, "num_hidden_layers": 4}
    cfg = ModelConfig.from_hf(raw)
    return dataclasses.replace(cfg, quantization=RELEASE_QUANTIZATION[V4])


def weight_bytes(cfg: ModelConfig) -> int:
    """The model's bytes in the release's formats (built on the meta device: nothing held)."""
    model = family(V4).build_model(cfg, torch.bfloat16, torch.device("meta"), quantized=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def experts_that_fit(free_bytes: int, kv_bytes: int) -> int:
    """The most routed experts per layer (a multiple of 8, at most MAX_EXPERTS) whose weights
    fit `free_bytes` beside the KV cache and MARGIN_BYTES."""
    small, large = (weight_bytes(full_config(e, smoke=False)) for e in (8, 16))
    per_expert = (large - small) / 8  # one more expert in every layer
    base = small - 8 * per_expert
    fit = int((free_bytes - kv_bytes - MARGIN_BYTES - base) // per_expert) // 8 * 8
    return max(8, min(MAX_EXPERTS, fit))


@torch.no_grad()
def random_release_model(cfg: ModelConfig, dev: torch.device) -> Any:
    """Random weights in the release's formats: FP8 codes N(0, 64^2) (|code| < 448) with a
    block scale of 2^round(log2(2^-6 / sqrt(K))), FP4 codes uniform over the 16 e2m1 values with
    a scale of 2^round(log2(1 / (rms * sqrt(K)))): dequantized weights of about 1/sqrt(K), as
    bench.engine.random_model's; the rest as there."""
    model = family(V4).build_model(cfg, torch.bfloat16, dev, quantized=True)
    gen = torch.Generator(dev).manual_seed(0)
    done: set[str] = set()

    def scale_byte(gain: float, k: int) -> int:
        return 127 + round(math.log2(gain / math.sqrt(k)))

    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            codes = torch.randn(m.weight.shape, device=dev, generator=gen) * 64
            m.weight.copy_(codes.to(torch.float8_e4m3fn))
            m.scale.view(torch.uint8).fill_(scale_byte(2**-6, m.in_features))
            done |= {f"{name}.weight", f"{name}.scale"}
        elif isinstance(m, Fp4Experts):
            for codes, scales in ((m.w13, m.s13), (m.w2, m.s2)):
                codes.view(torch.uint8).random_(0, 256, generator=gen)
                k = 2 * codes.shape[-1]
                scales.view(torch.uint8).fill_(scale_byte(1 / E2M1_RMS, k))
            m.note_scales()  # as the checkpoint loader does
            done |= {f"{name}.{p}" for p, _ in m.named_parameters()}
    fill_random(model, gen, skip=frozenset(done))
    return model.eval()


def kv_budget(cfg: ModelConfig, concurrency: int, context: int) -> int:
    """The smallest budget (to 1/8) whose pool plan (engine.kv.layout.plan_pages, as
    bench.engine.Bench's pool makes it) gives every group the pages of `concurrency` requests
    of `context` tokens and the steps run after them: window rings, compressed entries, the
    pool's fixed parts and its staging share."""
    kv = KVCacheConfig(memory_bytes=0, page_size=PAGE, max_num_seqs=concurrency)
    tokens = context + 64
    need = {
        g.name: concurrency
        * (ring_pages(cfg, PAGE) + (-(-tokens // g.ratio // PAGE) if g.ratio else 0))
        for g in cfg.kv_groups()
    }
    block = staging_block_bytes(cfg, PAGE, 2)
    budget = int(bytes_per_token(cfg, 2) * concurrency * tokens)
    while True:
        try:
            pages, _ = plan_pages(cfg, dataclasses.replace(kv, memory_bytes=budget), 2, block)
            if all(pages[g] >= n for g, n in need.items()):
                return budget
        except KVBudgetError:  # below the fixed costs
            pass
        budget += budget // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=0, help="0: as many as fit (<= 128)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny widths, 4 layers")
    args = parser.parse_args()
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    context = SMOKE_CONTEXT if smoke else CONTEXT
    concurrency = SMOKE_CONCURRENCY if smoke else CONCURRENCY
    steps = 2 if smoke else args.steps
    kv_bytes = kv_budget(full_config(8, smoke), max(concurrency), context)
    hw = None if smoke else hardware.measure(dev)
    if smoke:
        experts = args.experts or 8
    else:
        torch.cuda.empty_cache()  # (the measurement's buffers)
        experts = args.experts or experts_that_fit(torch.cuda.mem_get_info(dev)[0], kv_bytes)
    cfg = full_config(experts, smoke)
    result: dict = {
        **prologue(dev),
        "hardware": hw.as_dict() if hw else {},
        "config": {
            "layers": cfg.num_layers,
            "layer_types": {t: cfg.layer_types.count(t) for t in sorted(set(cfg.layer_types))},
            "routed_experts": experts,
            "weights_GB": weight_bytes(cfg) / 1e9,
            "kv_GB": kv_bytes / 1e9,
            "context": context,
        },
        "decode": [],
        "errors": {},
    }
    print(result["config"], flush=True)
    t0 = time.perf_counter()
    bench = Bench(
        cfg,
        max_seqs=max(concurrency),
        kv_bytes=kv_bytes,
        dev=dev,
        model=random_release_model(cfg, dev),
        graph_sizes=list(concurrency),
    )
    result["config"]["build_s"] = round(time.perf_counter() - t0, 1)
    for n in concurrency:
        try:
            tok_s, ms = bench.decode_tokens_per_s(n, context, steps)
            result["decode"].append({"concurrency": n, "tok_s": tok_s, "step_ms": ms})
            print(result["decode"][-1], flush=True)
        except Exception:
            result["errors"][f"decode c={n}"] = traceback.format_exc()
            print(result["errors"][f"decode c={n}"], flush=True)
        write_record(args.out, result, indent=1)
    for n in (1, 4 if smoke else 64):
        reqs = bench.requests(n, context)
        try:
            report = profile_decode(
                bench.decode_step,
                bench.runner,
                concurrency=n,
                context=context,
                steps=3,
                hardware=hw,
                setup={"model": f"V4-Flash, {experts} routed experts", "dtype": "release"},
            )
            result[f"profile_c{n}"] = report.as_dict()
            print(format_table(report), flush=True)
        except Exception:
            result["errors"][f"profile c={n}"] = traceback.format_exc()
            print(result["errors"][f"profile c={n}"], flush=True)
        finally:
            bench.release(reqs)
        write_record(args.out, result, indent=1)
    print_summary(result)


def print_summary(result: dict) -> None:
    c = result["config"]
    print(
        f"\n{result['device']}: V4-Flash {c['layers']} layers {c['layer_types']}, "
        f"{c['routed_experts']} routed experts, {c['weights_GB']:.1f} GB of weights, "
        f"{c['context']}-token context; failed: {sorted(result['errors']) or 'none'}"
    )
    print(f"{'conc':>5s} {'ms/step':>9s} {'tok/s':>9s}")
    for r in result["decode"]:
        print(f"{r['concurrency']:5d} {r['step_ms']:9.2f} {r['tok_s']:9.1f}")
    for key in ("profile_c1", "profile_c4", "profile_c64"):
        if key in result and result[key].get("floor_ms"):
            p = result[key]
            print(
                f"{key}: graphed step {p['step_ms']:.2f} ms, floors {p['floor_ms']:.2f} ms, "
                f"{p['step_over_floor']:.2f}x"
            )


if __name__ == "__main__":
    main()
