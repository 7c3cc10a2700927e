"""H200 benchmark of the quantized kernels: block-scaled FP8 GEMM on V4-Flash's linear shapes and
one FP4 MoE layer, each against torch in the same run.

    python -m bench.quant                      # -> bench/results/h200-quant.json
    python -m bench.quant --quick              # default configs only, no sweeps, no prefill MoE
    python -m bench.quant --only gemm          # one phase (the default runs each in a subprocess)
    python -m bench.quant --smoke              # CPU: tiny shapes through the same code, interpreter

Phases (each its own process, so a fault in one cannot poison the next one's CUDA context; each
writes its part of the JSON as soon as it has it):
- ``gemm``: ceilings (device-to-device copy bandwidth as bytes read + written, bf16 matmul and
  per-tensor FP8 ``torch._scaled_mm`` at 8192^3); correctness of ``fp8_linear`` against
  kernels.quant's reference on every shape first; then per shape and M in 1, 64, 4096:
  fp8_linear (default config), at M=4096 also the GEMM alone on act_quant's output and act_quant
  alone, torch bf16 matmul on the dequantized weight, and ``torch._scaled_mm`` with one scale per
  tensor (fast accumulation off and on). M <= 64 is compared with the weight bytes' floor at the
  measured copy bandwidth; M=4096 with _scaled_mm. Then other tile/split configs.
- ``moe``: one V4-Flash MoE layer (256 experts, hidden 4096, moe_intermediate 2048, top-6):
  correctness of fp4_moe against the release's expert arithmetic (kernels.quant) first, then 1
  and 64 decode rows (and 4096 prefill tokens unless --quick): fp4_moe vs engine.layers.experts'
  RoutedExperts (bf16 weights, torch._grouped_mm) on the same (dequantized) weights; few rows
  cycle through routings so that the weights come from HBM.

Times are medians of CUDA-event-timed CUDA-graph replays (eager launches where capture fails,
noted per row). For M <= 64 each replay cycles through enough weight copies (> 192 MB) that the
weights come from HBM, not L2. Weights are random codes and scales: speed does not depend on
the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import triton

from bench.compare import rel_err_or_nan
from bench.harness import (
    Env,
    attempt,
    ceilings,
    fmt,
    kernel_breakdown,
    prologue,
    read_record,
    timed,
    write_record,
)
from dsaserve import kernels  # noqa: F401  (before triton: on CPU, kernels.env picks the interpreter)
from dsaserve.kernels import fp8_gemm, quant
from dsaserve.kernels.act_quant import act_quant
from dsaserve.kernels.fp4_moe import MoeConfig, fp4_moe
from dsaserve.kernels.fp4_moe import default_config as moe_default_config
from dsaserve.kernels.fp8_gemm import GemmConfig, fp8_linear

DEFAULT_OUT = "bench/results/h200-quant.json"
ROTATE_BYTES = 192 << 20  # weight copies per timed unit in decode rows: well past the 50 MB L2

# V4-Flash's FP8 linears [N=out, K=in] (hidden 4096, q_lora 1024, 64 heads x 512, o_lora 1024 x
# 8 groups, moe_intermediate 2048 for the shared expert, indexer 64 heads x 128). wo_a is not
# here: the release's convert.py dequantizes it to bf16.
SHAPES = [
    ("wq_a", 1024, 4096),
    ("wq_b", 32768, 1024),
    ("wkv", 512, 4096),
    ("wo_b", 4096, 8192),
    ("shared_w1/w3", 2048, 4096),
    ("shared_w2", 4096, 2048),
    ("idx_wq_b", 8192, 1024),
]
ROWS = (1, 64, 4096)
SMOKE_SHAPES = [("tiny_a", 256, 256), ("tiny_b", 128, 384)]
SMOKE_ROWS = (1, 20, 130)

# one MoE layer of V4-Flash
MOE = dict(experts=256, hidden=4096, inter=2048, topk=6, limit=10.0)
SMOKE_MOE = dict(experts=8, hidden=256, inter=128, topk=2, limit=10.0)


# ---- FP8 GEMM ------------------------------------------------------------------------------


def random_fp8(rows: int, cols: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite e4m3 codes [rows, cols] and ue8m0 block scales near 2^-7."""
    codes = torch.randint(0, 256, (rows, cols), device=dev, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN
    scale = torch.randint(
        118, 123, (triton.cdiv(rows, 128), triton.cdiv(cols, 128)), device=dev, dtype=torch.int32
    ).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


@dataclasses.dataclass
class LinearCase:
    name: str
    n: int
    k: int
    weights: list[tuple[torch.Tensor, torch.Tensor]]  # rotating (fp8 [N, K], e8m0 scale) copies
    bf16: list[torch.Tensor]  # the same weights dequantized, [N, K] bf16

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k + self.n // 128 * self.k // 128


def linear_case(env: Env, name: str, n: int, k: int) -> LinearCase:
    copies = 1 if env.smoke else max(1, min(64, math.ceil(ROTATE_BYTES / (n * k))))
    w, s = random_fp8(copies * n, k, env.device)  # copies stacked along N: slices stay contiguous
    weights = [
        (w[i * n : (i + 1) * n], s[i * n // 128 : (i + 1) * n // 128]) for i in range(copies)
    ]
    bf16 = [quant.dequantize_fp8_blocks(wi, si).to(torch.bfloat16) for wi, si in weights]
    return LinearCase(name, n, k, weights, bf16)


def check_linear(env: Env, case: LinearCase, m: int) -> dict:
    """fp8_linear (default config) vs the reference on (up to) 64 rows."""
    x = torch.randn(m, case.k, device=env.device, dtype=torch.bfloat16)
    w, s = case.weights[0]
    out = fp8_linear(x, w, s)
    ref = quant.fp8_linear_reference(x[:64], w, s)
    err = rel_err_or_nan(out[:64], ref)
    exact = (out[:64] == ref).float().mean().item()
    cfg = fp8_gemm.default_config(m, case.n, case.k, env.device)
    return {
        "shape": case.name,
        "N": case.n,
        "K": case.k,
        "M": m,
        "rel_err": err,
        "bf16_equal": exact,
        "ok": err < 4e-3,
        "config": dataclasses.asdict(cfg),
    }


def check_act_quant(env: Env, m: int, k: int) -> dict:
    x = torch.randn(m, k, device=env.device, dtype=torch.bfloat16) * 3
    q, s = act_quant(x)
    rq, rs = quant.act_quant_reference(x)
    ok = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(
        s.view(torch.uint8), rs.view(torch.uint8)
    )
    return {"M": m, "K": k, "bit_exact": ok}


def scaled_mm_fn(fast: bool):
    def run(xq, w, one):
        return torch._scaled_mm(xq, w.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)

    return run


def bench_linear(env: Env, case: LinearCase, m: int, hw: dict) -> dict:
    dev = env.device
    x = torch.randn(m, case.k, device=dev, dtype=torch.bfloat16)
    rot = case.weights if m <= 64 else case.weights[:1]
    cfg = fp8_gemm.default_config(m, case.n, case.k, dev)
    row = {
        "shape": case.name,
        "N": case.n,
        "K": case.k,
        "M": m,
        "copies": len(rot),
        "weight_MB": case.weight_bytes / 1e6,
        "config": dataclasses.asdict(cfg),
    }
    t = attempt(f"{case.name} M={m} triton", timed, env, lambda w, s: fp8_linear(x, w, s), rot)
    if isinstance(t, tuple):
        row["triton_us"], row["timing"] = 1e3 * t[0], t[1]
    if m > 64:  # the GEMM alone on act_quant's output, and act_quant alone
        xq, xs = act_quant(x)
        t = attempt(
            f"{case.name} M={m} triton gemm",
            timed,
            env,
            lambda w, s: fp8_gemm.fp8_gemm(xq, xs, w, s),
            rot,
        )
        if isinstance(t, tuple):
            row["triton_gemm_us"] = 1e3 * t[0]
        t = attempt(f"{case.name} M={m} act_quant", timed, env, lambda: act_quant(x), [()])
        if isinstance(t, tuple):
            row["act_quant_us"] = 1e3 * t[0]
    bf16_sets = [(w,) for w in (case.bf16 if m <= 64 else case.bf16[:1])]
    t = attempt(f"{case.name} M={m} bf16", timed, env, lambda w: x @ w.t(), bf16_sets)
    if isinstance(t, tuple):
        row["bf16_us"] = 1e3 * t[0]
    # per-tensor FP8 cuBLAS (rows padded to 16: its minimum)
    xq8 = torch.zeros(max(m, 16), case.k, device=dev, dtype=torch.bfloat16)
    xq8[:m] = x
    xq8 = xq8.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    for fast in (False, True):
        key = "scaled_mm_fast_us" if fast else "scaled_mm_us"
        t = attempt(
            f"{case.name} M={m} {key}",
            timed,
            env,
            scaled_mm_fn(fast),
            [(xq8, w, one) for w, _ in rot],
        )
        if isinstance(t, tuple):
            row[key] = 1e3 * t[0]
    flop = 2.0 * m * case.n * case.k
    if "triton_us" in row:
        row["TFLOPs"] = flop / row["triton_us"] / 1e6
        row["weight_GBps"] = case.weight_bytes / row["triton_us"] / 1e3
    if m <= 64 and "triton_us" in row:
        row["floor_us"] = case.weight_bytes / hw.get("copy_GBps", float("nan")) / 1e3
        row["x_floor"] = row["triton_us"] / row["floor_us"]
    if m > 64:
        for key in ("scaled_mm_us", "scaled_mm_fast_us"):
            if key in row and "triton_gemm_us" in row:
                row["gemm_share_of_" + key[:-3]] = row[key] / row["triton_gemm_us"]
            if key in row and "triton_us" in row:
                row["linear_share_of_" + key[:-3]] = row[key] / row["triton_us"]
    print_linear_row(row)
    return row


def print_linear_row(r: dict) -> None:
    c = r["config"]
    cfg = f"m{c['block_m']} n{c['block_n']} s{c['split_k']} {'fq' if c['fuse_quant'] else 'aq'}"
    extra = ""
    if r["M"] <= 64:
        extra = f" floor {fmt(r.get('floor_us'), '6.1f')} us x{fmt(r.get('x_floor'), '4.2f')}"
    else:
        share = 100 * r.get("gemm_share_of_scaled_mm", float("nan"))
        share_fast = 100 * r.get("gemm_share_of_scaled_mm_fast", float("nan"))
        extra = (
            f" gemm {fmt(r.get('triton_gemm_us'))} aq {fmt(r.get('act_quant_us'), '6.1f')}"
            f" {fmt(r.get('TFLOPs'), '6.0f')} TF/s gemm/_scaled_mm {fmt(share, '5.1f')}%"
            f" (fast acc {fmt(share_fast, '5.1f')}%)"
        )
    print(
        f"{r['shape']:>13} N={r['N']:<6} K={r['K']:<5} M={r['M']:<5} {cfg:<18}"
        f" triton {fmt(r.get('triton_us'))} us bf16 {fmt(r.get('bf16_us'))}"
        f" _scaled_mm {fmt(r.get('scaled_mm_us'))}/{fmt(r.get('scaled_mm_fast_us'))}{extra}",
        flush=True,
    )


def decode_alternatives(m: int) -> list[GemmConfig]:
    bm = max(16, triton.next_power_of_2(m))
    out = [GemmConfig(bm, bn, split, 1, True, 4, 4) for bn in (32, 64, 128) for split in (1, 4, 16)]
    out.append(GemmConfig(bm, 64, 4, 1, False, 4, 4))  # act_quant as its own launch
    out.append(GemmConfig(64, 64, 4, 1, True, 4, 4))  # rows padded to 64: wgmma
    return out


PREFILL_ALTERNATIVES = [
    GemmConfig(128, 128, 1, 8, False, 8, 3),
    GemmConfig(128, 256, 1, 8, False, 8, 3),
    GemmConfig(256, 128, 1, 8, False, 8, 3),
    GemmConfig(64, 256, 1, 8, False, 4, 4),
    GemmConfig(128, 64, 1, 8, False, 4, 4),
    GemmConfig(128, 128, 1, 16, False, 8, 5),
]


def bench_alternatives(env: Env, case: LinearCase, m: int, configs: list[GemmConfig]) -> list:
    rows = []
    x = torch.randn(m, case.k, device=env.device, dtype=torch.bfloat16)
    rot = case.weights if m <= 64 else case.weights[:1]
    xq, xs = act_quant(x)
    ref = quant.fp8_linear_reference(x[:64], *case.weights[0])
    for cfg in configs:

        def run(w, s, cfg=cfg):
            if m > 64:  # prefill: the GEMM alone (act_quant is the same for every config)
                return fp8_gemm.fp8_gemm(xq, xs, w, s, config=cfg)
            return fp8_linear(x, w, s, config=cfg)

        label = f"{case.name} M={m} {cfg}"
        try:
            out = run(*case.weights[0])
            err = rel_err_or_nan(out[:64], ref)
            ms, mode = timed(env, run, rot)
        except Exception as e:
            print(f"  {label}: {type(e).__name__} {str(e)[:200]}", flush=True)
            rows.append(
                {
                    "shape": case.name,
                    "M": m,
                    "config": dataclasses.asdict(cfg),
                    "error": f"{type(e).__name__}: {str(e)[:300]}",
                }
            )
            continue
        row = {
            "shape": case.name,
            "N": case.n,
            "K": case.k,
            "M": m,
            "rel_err": err,
            "config": dataclasses.asdict(cfg),
            "us": 1e3 * ms,
            "timing": mode,
            "TFLOPs": 2.0 * m * case.n * case.k / ms / 1e9,
        }
        rows.append(row)
        print(
            f"  {case.name:>13} M={m:<5} {cfg.block_m}x{cfg.block_n} split {cfg.split_k} "
            f"{'fused' if cfg.fuse_quant else 'act_quant'} w{cfg.num_warps} st{cfg.num_stages}"
            f" g{cfg.group_m}: err {err:.1e} {fmt(row['us'])} us"
            f" {fmt(row['TFLOPs'], '6.0f')} TF/s",
            flush=True,
        )
    return rows


def phase_gemm(env: Env, result: dict, save: Callable[[], None]) -> None:
    hw = attempt("ceilings", ceilings, env.device, env.smoke)
    if "copy_GBps" not in hw:  # reported; the ratios to it come out NaN
        hw = {"copy_GBps": float("nan"), "bf16_matmul_TFLOPs": float("nan"), **hw}
    result["ceilings"] = hw
    print(
        f"ceilings: copy {fmt(hw['copy_GBps'], '.0f')} GB/s (read + write), bf16 matmul "
        f"{fmt(hw['bf16_matmul_TFLOPs'], '.0f')} TFLOP/s, fp8 _scaled_mm "
        f"{fmt(hw.get('fp8_scaled_mm_TFLOPs'), '.0f')} TFLOP/s",
        flush=True,
    )
    shapes, rows_m = (SMOKE_SHAPES, SMOKE_ROWS) if env.smoke else (SHAPES, ROWS)

    print("correctness (fp8_linear default config vs kernels.quant reference, <= 64 rows):")
    checks = [
        attempt(
            "act_quant",
            check_act_quant,
            env,
            4096 if not env.smoke else 9,
            4096 if not env.smoke else 256,
        )
    ]
    print(f"  act_quant bit-exact: {checks[0]}", flush=True)
    cases = {}
    for name, n, k in shapes:
        case = attempt(f"{name} setup", linear_case, env, name, n, k)
        if isinstance(case, dict):
            continue
        cases[name] = case
        for m in rows_m:
            c = attempt(f"{name} M={m} check", check_linear, env, case, m)
            checks.append(c)
            if "rel_err" in c:
                print(
                    f"  {name:>13} M={m:<5} rel err {c['rel_err']:.2e} bf16-equal "
                    f"{100 * c['bf16_equal']:.1f}% {'ok' if c['ok'] else 'MISMATCH'}",
                    flush=True,
                )
    result["gemm_correctness"] = checks
    save()

    print("timing (us per call):")
    rows = []
    for name, case in cases.items():
        for m in rows_m:
            r = attempt(f"{name} M={m} bench", bench_linear, env, case, m, hw)
            rows.append(r)
    result["gemm"] = rows
    summarize_gemm(rows, result)
    save()
    if env.quick:
        return
    print("alternatives:")
    alt = []
    result["gemm_alternatives"] = alt
    for name, case in cases.items():
        for m in rows_m:
            configs = None
            if m <= 64 and name in ("wq_a", "wq_b", "wkv", "wo_b", "tiny_a"):
                configs = decode_alternatives(m)
            elif m > 64:
                configs = PREFILL_ALTERNATIVES
            if configs:
                got = attempt(
                    f"{name} M={m} alternatives", bench_alternatives, env, case, m, configs
                )
                alt += got if isinstance(got, list) else [got]
        save()
    result["gemm_alternatives"] = alt
    save()


def summarize_gemm(rows: list[dict], result: dict) -> None:
    """The issue's targets: M <= 64 within 1.3x of the weight floor; M=4096 >= 90% of
    _scaled_mm."""
    lines = []
    for r in rows:
        if "error" in r:
            continue
        if r["M"] <= 64 and "x_floor" in r:
            lines.append(f"{r['shape']} M={r['M']}: {r['x_floor']:.2f}x the weight floor (<= 1.3)")
        if r["M"] > 64 and "gemm_share_of_scaled_mm" in r:
            lines.append(
                f"{r['shape']} M={r['M']}: GEMM {100 * r['gemm_share_of_scaled_mm']:.0f}%"
                f" of _scaled_mm (>= 90), with act_quant "
                f"{100 * r.get('linear_share_of_scaled_mm', float('nan')):.0f}%"
            )
    for line in lines:
        print("target " + line)
    result["gemm_targets"] = lines


# ---- FP4 MoE -------------------------------------------------------------------------------


@dataclasses.dataclass
class MoeLayer:
    w13: torch.Tensor  # [E, 2I, H/2] int8
    s13: torch.Tensor  # [E, 2I, H/32] e8m0
    w2: torch.Tensor  # [E, H, I/2] int8
    s2: torch.Tensor  # [E, H, I/32] e8m0
    bf16: torch.nn.Module | None  # engine's RoutedExperts on the dequantized weights

    def fp4_bytes(self, active: int) -> int:
        per = self.w13[0].numel() + self.s13[0].numel() + self.w2[0].numel() + self.s2[0].numel()
        return active * per


def moe_layer(env: Env, spec: dict) -> MoeLayer:
    e, h, i = spec["experts"], spec["hidden"], spec["inter"]
    dev = env.device

    def scales(*shape):
        return (
            torch.randint(118, 123, shape, device=dev, dtype=torch.int32)
            .to(torch.uint8)
            .view(torch.float8_e8m0fnu)
        )

    w13 = torch.randint(-128, 128, (e, 2 * i, h // 2), device=dev, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (e, h, i // 2), device=dev, dtype=torch.int8)
    s13, s2 = scales(e, 2 * i, h // 32), scales(e, h, i // 32)
    bf16 = attempt("bf16 experts setup", bf16_experts, env, spec, w13, s13, w2, s2)
    return MoeLayer(w13, s13, w2, s2, None if isinstance(bf16, dict) else bf16)


def bf16_experts(env: Env, spec: dict, w13, s13, w2, s2) -> torch.nn.Module:
    """engine.layers.experts.RoutedExperts (torch._grouped_mm) holding the dequantized weights."""
    from dsaserve.engine.layers.experts import RoutedExperts

    with torch.device("meta"):
        mod = RoutedExperts(spec["experts"], spec["hidden"], spec["inter"], spec["limit"])
    mod = mod.to(torch.bfloat16).to_empty(device=env.device)
    with torch.no_grad():
        for e in range(spec["experts"]):
            mod.w13[e].copy_(quant.dequantize_fp4(w13[e], s13[e]))
            mod.w2[e].copy_(quant.dequantize_fp4(w2[e], s2[e]))
    return mod


def routing(
    env: Env, spec: dict, tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(env.device).manual_seed(seed)
    x = torch.randn(tokens, spec["hidden"], device=env.device, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, spec["experts"], device=env.device, generator=g)
    w, ids = scores.topk(spec["topk"], dim=1)
    return x, ids, (w / w.sum(1, keepdim=True) * 1.5).float()


def moe_variants(env: Env, tokens: int, spec: dict) -> list[MoeConfig | None]:
    if env.quick:  # the default decodes nibbles with inline PTX on the GPU; beside it, its
        # tiles without split-K, and plain Triton
        unsplit = [MoeConfig(16, 128, 4, 4, True), MoeConfig(16, 64, 4, 4, False)]
        return [None, *unsplit] if tokens <= 256 else [None]
    if tokens <= 256:
        return [None] + [
            MoeConfig(16, bn, w, st, asm)
            for asm in (False, True)
            for bn, w, st in ((128, 4, 3), (64, 4, 4), (256, 8, 4), (128, 8, 4))
        ]
    return [
        None,
        MoeConfig(32, 64, 8, 4, True),
        MoeConfig(32, 128, 4, 3, True),
        MoeConfig(64, 128, 8, 3, True),
    ]


def bench_moe(env: Env, layer: MoeLayer, spec: dict, tokens: int, hw: dict, check: bool) -> dict:
    x, ids, wts = routing(env, spec, tokens, seed=tokens)
    active = int(torch.unique(ids).numel())
    # Few tokens hit few experts, whose weights L2 would keep between calls: cycle through
    # routings (other experts) until a timed unit reads more than ROTATE_BYTES.
    rotations = max(1, math.ceil(ROTATE_BYTES / layer.fp4_bytes(active)))
    arg_sets = [(x, ids, wts)] + [
        routing(env, spec, tokens, seed=tokens + 1000 * r) for r in range(1, rotations)
    ]
    res = {
        "tokens": tokens,
        "topk": spec["topk"],
        "experts": spec["experts"],
        "active_experts": active,
        "fp4_weight_MB": layer.fp4_bytes(active) / 1e6,
        "variants": [],
    }
    ref = None
    if check:
        ref = attempt(
            "moe reference",
            quant.fp4_experts_reference,
            x,
            ids,
            wts,
            layer.w13,
            layer.s13,
            layer.w2,
            layer.s2,
            spec["limit"],
        )
        ref = None if isinstance(ref, dict) else ref
    for cfg in moe_variants(env, tokens, spec):
        used = cfg or moe_default_config(tokens * spec["topk"], spec["experts"], env.device)
        row = {"config": dataclasses.asdict(used), "default": cfg is None}

        def run(x=x, ids=ids, wts=wts, cfg=cfg):
            return fp4_moe(
                x, ids, wts, layer.w13, layer.s13, layer.w2, layer.s2, spec["limit"], config=cfg
            )

        if ref is not None:
            out = attempt(f"fp4 moe {used}", run)
            if isinstance(out, dict):
                row.update(out)
                res["variants"].append(row)
                continue
            row["rel_err"] = rel_err_or_nan(out, ref)
            row["ok"] = row["rel_err"] < 4e-3
        t = attempt(f"fp4 moe time {used}", timed, env, run, arg_sets)
        if cfg is None and not env.smoke:
            row["kernels_us"] = attempt("fp4 moe kernels", kernel_breakdown, run, arg_sets[0])
        if isinstance(t, tuple):
            row["us"], row["timing"] = 1e3 * t[0], t[1]
            row["GBps"] = layer.fp4_bytes(active) / row["us"] / 1e3
            row["share_copy"] = row["GBps"] / hw["copy_GBps"]
        else:
            row.update(t)
        res["variants"].append(row)
        c = row["config"]
        print(
            f"  fp4 T={tokens:<5} m{c['block_m']} n{c['block_n']} w{c['num_warps']} "
            f"st{c['num_stages']} {'asm' if c['use_asm'] else 'plain'} split {c['split_k']}"
            f"{' (default)' if cfg is None else ''}: err {fmt(row.get('rel_err'), '.1e')}"
            f" {fmt(row.get('us'), '8.1f')} us {fmt(row.get('GBps'), '6.0f')} GB/s",
            flush=True,
        )
    if layer.bf16 is not None:
        with torch.no_grad():
            if ref is not None:
                out = attempt("bf16 moe", layer.bf16, x, ids, wts)
                if not isinstance(out, dict):
                    res["bf16_rel_diff_vs_release"] = rel_err_or_nan(out, ref)
            t = attempt("bf16 moe time", timed, env, layer.bf16, arg_sets)
        if isinstance(t, tuple):
            res["bf16_us"], res["bf16_timing"] = 1e3 * t[0], t[1]
    measured = [v for v in res["variants"] if "us" in v and v.get("ok", True)]
    if measured:
        best = min(measured, key=lambda v: v["us"])
        res["best"] = best["config"]
        res["best_us"] = best["us"]
        default = [v for v in measured if v["default"]]
        if "bf16_us" in res:
            res["x_bf16_best"] = res["bf16_us"] / best["us"]
            if default:
                res["x_bf16_default"] = res["bf16_us"] / default[0]["us"]
    print(
        f"  bf16 grouped_mm (engine RoutedExperts) T={tokens}: {fmt(res.get('bf16_us'))} us;"
        f" fp4 best {fmt(res.get('best_us'))} us -> x{fmt(res.get('x_bf16_best'), '.2f')}"
        f" (default x{fmt(res.get('x_bf16_default'), '.2f')}; target >= 3 at 64 rows);"
        f" {active} experts hit, {res['fp4_weight_MB']:.0f} MB of FP4 weights",
        flush=True,
    )
    return res


def phase_moe(env: Env, result: dict, save: Callable[[], None]) -> None:
    spec = SMOKE_MOE if env.smoke else MOE
    hw = result.get("ceilings") or attempt("ceilings", ceilings, env.device, env.smoke)
    if "copy_GBps" not in hw:
        hw = {"copy_GBps": float("nan")}
    print(f"MoE layer: {spec}", flush=True)
    layer = moe_layer(env, spec)
    runs = [  # decode at concurrency 1 and 64
        attempt(f"moe T={t}", bench_moe, env, layer, spec, t, hw, check=True)
        for t in ((1, 4) if env.smoke else (1, 64))
    ]
    result["moe"] = runs
    save()
    if not env.quick:
        tokens = 4096 if not env.smoke else 40
        runs.append(attempt(f"moe T={tokens}", bench_moe, env, layer, spec, tokens, hw, check=True))
        save()


# ---- driver --------------------------------------------------------------------------------


PHASES = {"gemm": phase_gemm, "moe": phase_moe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=None,
        help=f"JSON to write (merged into if it exists); default {DEFAULT_OUT}, none with --smoke",
    )
    ap.add_argument("--only", choices=sorted(PHASES), help="run one phase in this process")
    ap.add_argument("--quick", action="store_true", help="default configs only, no prefill MoE")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU smoke: tiny shapes, Triton interpreter, no timing"
    )
    args = ap.parse_args()
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    if args.only is None:  # each phase in its own process: a CUDA fault stays in its phase
        failed = []
        for phase in PHASES:
            cmd = (
                [sys.executable, "-m", "bench.quant", "--only", phase]
                + (["--out", out] if out else [])
                + (["--quick"] if args.quick else [])
                + (["--smoke"] if args.smoke else [])
            )
            print(f"== phase {phase}: {' '.join(cmd[1:])}", flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                print(f"== phase {phase} FAILED (exit {rc}); going on", flush=True)
                failed.append(phase)
        print(f"== done; failed phases: {failed or 'none'}; JSON: {out}")
        sys.exit(1 if failed else 0)

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench.quant needs CUDA (use --smoke on CPU)")
    env = Env(torch.device("cpu" if args.smoke else "cuda"), args.smoke, args.quick)
    t0 = time.time()
    result = read_record(out)
    run = {"phase": args.only, **prologue(env.device), "quick": args.quick}
    result.setdefault("runs", []).append(run)
    result["timing"] = (
        "median ms per call over CUDA-graph replays (eager where noted); decode "
        f"rows rotate weight copies over > {ROTATE_BYTES >> 20} MB"
    )
    machine = f"{run['device']}, {run['sms']} SMs, torch {run['torch']}, triton {run['triton']}"
    print(machine, flush=True)

    def save() -> None:  # after each section, so a run cut short keeps what it measured
        run["wall_s"] = time.time() - t0
        write_record(out, result)

    PHASES[args.only](env, result, save)
    save()


if __name__ == "__main__":
    main()
