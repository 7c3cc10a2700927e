"""The release formats on the GPU against the release's own arithmetic: is an error the format's
cost or ours? (issue 39)

    python -m bench.release_numerics --out bench/results/h100-release-numerics.json
    python -m bench.release_numerics --smoke       # CPU: tiny widths, every phase, Triton
                                                   # in its interpreter
    python -m bench.release_numerics --only kernels slice demo

Three phases (run with the demo model's first), each judged by an fp32 reference of the
release's arithmetic (kernels.quant's act_quant and block-scaled GEMMs, bench.fake_quant for
whole models):

1. kernels: every release-format kernel path at the real widths, each on the same inputs as the
   exact reference (fp32 accumulation of exact block products, no bf16 rounding): the FP8 GEMM on
   each linear of V4-Flash and DeepSeek-V3.2 at 1, 64 and 2048 rows; the FP4 routed experts
   (Triton, and Gluon on sm_90 with either decode) and V3.2's FP8 experts (Triton) at 1, 64 and
   2048 tokens; act_quant bit for bit. Reported: relative error and the largest error in bf16
   ulps at its row's largest value (a GEMM rounds its fp32 sum to bf16 once: <= 0.5 plus
   fp32 order; an expert's intermediate bf16 and act_quant steps can move more).
2. slice: the V4-Flash-width slice (6 layers, 16 experts) and the V3.2-width one (4 layers) of
   bench/engine.py, random weights quantized to the release's formats; a 2048-token prompt and
   4 decode rows through the GPU path, the GPU path with the Triton kernels only, and plain torch
   in bf16 (the floor: what bf16 rounding costs through the release's arithmetic), each against
   the fp32 reference; per layer with teacher forcing (each layer fed the reference's input),
   the prompt free-running, and the logits. The dense bf16 slice against its fp32 self beside it
   (what the issue's 0.011 at the first layer was).
3. demo: the built-in trained model (engine/assets/dsaserve-demo-v4) converted to the release's
   formats (`release_demo_model`: FP8 linears, FP4 experts; q_lora 48 and the experts' 80 padded
   with zeros to the 128-value blocks the release needs); bits per byte on held-out text: fp32
   CPU (the original, and padded: the padding's own cost), release CPU fake-quant (fp32 with the
   release's arithmetic), bf16 GPU, release GPU; greedy continuations and teacher-forced argmax
   of the release GPU against the release CPU.

Targets (issue 39): per-layer relative error <= 1e-2 and logits <= 3e-2 against the reference;
the release's bits per byte within 2% of fp32; GPU within 0.2% of the CPU fake-quant; greedy
tokens equal.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# (first: before triton is imported, on a CPU it turns Triton's interpreter on)
from dsaserve.kernels import env  # noqa: F401

# isort: split
from bench.compare import rel_err_or_nan
from bench.engine import V4, V32, random_model, release_model, slice_config
from bench.fake_quant import (
    OnePrompt,
    Trace,
    compare,
    layer_labels,
    reference_model,
)
from bench.harness import prologue, write_record
from bench.numerics import BOS, bits_per_byte, greedy_agreement, heldout_windows
from bench.quant import random_fp8
from dsaserve import kernels
from dsaserve.engine import models
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v4.tiny import release_names, save_release
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.kernels import quant
from dsaserve.kernels.quant import FP8_BLOCK

# The FP8 linears (N, K) of each family at its real widths (shared/reference/v4-release.md;
# bench/v32_widths.py): attention projections, the indexer's query, shared / dense experts
LINEARS = {
    V4: {
        "wq_a": (1024, 4096),
        "wq_b": (32768, 1024),
        "wkv": (512, 4096),
        "wo_b": (4096, 8192),
        "indexer.wq_b": (8192, 1024),
        "shared.w1": (2048, 4096),
        "shared.w2": (4096, 2048),
    },
    V32: {
        "wq_a": (1536, 7168),
        "wq_b": (24576, 1536),
        "wkv_a": (576, 7168),
        "wkv_b": (32768, 512),
        "wo": (7168, 16384),
        "indexer.wq_b": (8192, 1536),
        "dense.w1": (18432, 7168),
        "dense.w2": (7168, 18432),
    },
}
SMOKE_LINEARS = {"small": (256, 384), "tall": (640, 128)}
ROWS, SMOKE_ROWS = (1, 64, 2048), (1, 5)
# Routed experts: (experts, hidden, intermediate, top-k) at the real widths, fewer experts for
# V3.2's FP8 ones (their bytes); smoke: tiny
EXPERTS = {"fp4": (256, 4096, 2048, 6), "fp8": (32, 7168, 2048, 8)}
SMOKE_EXPERTS = {"fp4": (8, 256, 128, 2), "fp8": (8, 256, 256, 2)}
SLICE_EXPERTS = 16
PROMPT, SMOKE_PROMPT = 2048, 48
DECODE_ROWS = 4
POOL_BYTES, SMOKE_POOL_BYTES = 1 << 30, 48 << 20
DEMO_WINDOWS, SMOKE_DEMO_WINDOWS = 32, 2  # held-out windows of the card's 512 bytes
DEMO_PROMPTS, DEMO_STEPS = 8, 128


# ---- 1. kernels ------------------------------------------------------------------------------


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| of each row in units of one bf16 ulp at that row's largest
    |ref| (a bf16 output rounded once from the exact sum is within 0.5; an element's own ulp
    would blow up where a sum cancels to near zero)."""
    ref2, got2 = ref.float().flatten(0, -2), got.float().flatten(0, -2)  # [rows, N]
    _, exp = torch.frexp(ref2.abs().amax(-1, keepdim=True))
    ulp = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp - 8)  # 8 mantissa bits
    return ((got2 - ref2).abs() / ulp).max().item()


def error_row(got: torch.Tensor, ref: torch.Tensor, **fields: Any) -> dict:
    return {**fields, "rel_err": rel_err_or_nan(got, ref), "max_row_bf16_ulps": bf16_ulps(got, ref)}


def check_linears(dev: torch.device, smoke: bool) -> list[dict]:
    """kernels.fp8_linear (the GPU's dispatch) against the exact reference, fp32 out."""
    rows = []
    shapes = {"smoke": SMOKE_LINEARS} if smoke else LINEARS
    for fam, layers in shapes.items():
        for name, (n, k) in layers.items():
            w, s = random_fp8(n, k, dev)
            for m in SMOKE_ROWS if smoke else ROWS:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)  # [M, K]
                got = _triton(kernels.fp8_linear, x, w, s)  # [M, N] bf16 (no Gluon twin)
                ref = quant.fp8_linear_reference(x, w, s, out_dtype=torch.float32)
                rows.append(error_row(got, ref, kernel="fp8_linear", model=fam, layer=name, M=m))
                print(rows[-1], flush=True)
    return rows


def expert_case(kind: str, dev: torch.device, smoke: bool, tokens: int, seed: int) -> tuple:
    """Random routed experts in the release's format and a batch routed to them:
    (x [T, H] bf16, ids [T, k], weights [T, k] fp32, w13, s13, w2, s2)."""
    e, h, inter, k = (SMOKE_EXPERTS if smoke else EXPERTS)[kind]
    g = torch.Generator(dev).manual_seed(seed)
    if kind == "fp4":
        w13 = torch.randint(-128, 128, (e, 2 * inter, h // 2), device=dev, dtype=torch.int8)
        w2 = torch.randint(-128, 128, (e, h, inter // 2), device=dev, dtype=torch.int8)

        def scales(*shape: int) -> torch.Tensor:  # near 2^-7: values O(1) out
            byte = torch.randint(118, 123, shape, device=dev, dtype=torch.int32)
            return byte.to(torch.uint8).view(torch.float8_e8m0fnu)

        s13, s2 = scales(e, 2 * inter, h // 32), scales(e, h, inter // 32)
    else:
        w13, s13 = random_fp8(e * 2 * inter, h, dev)
        w2, s2 = random_fp8(e * h, inter, dev)
        w13, w2 = w13.view(e, 2 * inter, h), w2.view(e, h, inter)
        s13 = s13.view(e, 2 * inter // FP8_BLOCK, h // FP8_BLOCK)
        s2 = s2.view(e, h // FP8_BLOCK, inter // FP8_BLOCK)
    x = torch.randn(tokens, h, device=dev, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, e, device=dev, generator=g)
    w, ids = scores.topk(k, dim=1)
    return x, ids, (w / w.sum(1, keepdim=True) * 1.5).float(), w13, s13, w2, s2


def check_experts(dev: torch.device, smoke: bool) -> list[dict]:
    """The routed experts' kernels against the exact reference on the same inputs."""
    rows = []
    limit = 10.0  # V4-Flash's swiglu_limit
    gluon = dev.type == "cuda" and kernels.backend.uses_gluon(torch.empty(0, device=dev))
    for tokens in SMOKE_ROWS if smoke else ROWS:
        case = expert_case("fp4", dev, smoke, tokens, seed=tokens)
        ref = quant.fp4_experts_reference(*case, limit)
        # (name, backend, narrow decode): the GPU's dispatch runs Gluon where it takes the
        # shape, with either decode; "triton" forces the Triton kernel
        variants = [(f"gluon narrow={n}", None, n) for n in (False, True) if gluon]
        for name, backend, narrow in [*variants, ("triton", "triton", False)]:
            with kernels.use_backend(backend):
                got = kernels.fp4_experts(*case, limit, narrow_scales=narrow)
            rows.append(error_row(got, ref, kernel=f"fp4_experts {name}", tokens=tokens))
            print(rows[-1], flush=True)
        case = expert_case("fp8", dev, smoke, tokens, seed=100 + tokens)
        ref = quant.fp8_experts_reference(*case)
        got = _triton(kernels.fp8_experts, *case)
        rows.append(error_row(got, ref, kernel="fp8_experts triton", tokens=tokens))
        print(rows[-1], flush=True)
    return rows


def _triton(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    with kernels.use_backend("triton"):
        return fn(*args)


def check_act_quant(dev: torch.device, smoke: bool) -> dict:
    """The Triton act_quant's codes and scales against the reference's, bit for bit."""
    x = torch.randn(64 if smoke else 8192, 4096 if not smoke else 256, device=dev) * 3
    x = x.to(torch.bfloat16)
    q, s = _triton(kernels.quantize_activations, x)
    rq, rs = quant.act_quant_reference(x)
    return {
        "kernel": "act_quant",
        "values": x.numel(),
        "code_mismatches": int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()),
        "scale_mismatches": int((s.view(torch.uint8) != rs.view(torch.uint8)).sum()),
    }


# ---- 2. slices -------------------------------------------------------------------------------


def run_prompt(
    model: Any, ids: list[int], decode: list[int], pool_bytes: int, teacher: list[Trace] | None
) -> list[Trace]:
    """The prompt, then one decode row per token of `decode`: a trace of each step."""
    prompt = OnePrompt(model, ids, pool_bytes)
    traces = [prompt.run(teacher[0] if teacher else None)]
    for i, tok in enumerate(decode):
        traces.append(prompt.decode(tok, teacher[i + 1] if teacher else None))
    return traces


def judge(
    model: Any,
    ref: list[Trace],
    ids: list[int],
    decode: list[int],
    pool_bytes: int,
    backend: str | None,
) -> dict:
    """`model` (on its backend: None = the device's dispatch) against the reference traces:
    teacher-forced per layer at the prompt and at each decode row, and the prompt free-running."""
    labels = layer_labels(model.cfg)
    with kernels.use_backend(backend):
        forced = run_prompt(model, ids, decode, pool_bytes, ref)
        free = run_prompt(model, ids, [], pool_bytes, None)[0]
    prompt = compare(forced[0], ref[0], labels)
    rows = [compare(t, r, labels) for t, r in zip(forced[1:], ref[1:], strict=True)]
    return {
        "prompt_per_layer": [round(r["rel_err"], 5) for r in prompt["layers"]],
        "prompt_logits": prompt["logits_rel_err"],
        "decode_per_layer_max": [
            round(max(r["layers"][i]["rel_err"] for r in rows), 5) for i in range(len(labels))
        ],
        "decode_logits_max": max(r["logits_rel_err"] for r in rows),
        "argmax_agrees": all(r["argmax_agrees"] for r in [prompt, *rows]),
        "free_running_per_layer": [
            round(rel_err_or_nan(a, b), 5)
            for a, b in zip(free.outputs, ref[0].outputs, strict=True)
        ],
        "free_running_logits": rel_err_or_nan(free.logits, ref[0].logits),
    }


def check_slice(model_type: str, dev: torch.device, smoke: bool) -> dict:
    """A slice in the release's formats: the GPU path, Triton only, and bf16 torch against the
    fp32 reference; the dense bf16 slice against its fp32 self."""
    cfg = slice_config(SLICE_EXPERTS, smoke, model_type)
    pool_bytes = SMOKE_POOL_BYTES if smoke else POOL_BYTES
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (SMOKE_PROMPT if smoke else PROMPT,), generator=g)
    ids = ids.tolist()
    dense = random_model(cfg, dev)
    out: dict = {"model_type": model_type, "layers": layer_labels(cfg), "prompt": len(ids)}

    def versus_reference(model: Any, variants: dict[str, str | None]) -> dict:
        ref_model = reference_model(model)
        with kernels.use_backend("reference"):
            first = run_prompt(ref_model, ids, [], pool_bytes, None)
            # decode the reference's own greedy tokens (the same for every variant)
            decode = [int(first[0].logits.argmax())] + [7] * (DECODE_ROWS - 1)
            ref = run_prompt(ref_model, ids, decode, pool_bytes, None)
        del ref_model
        rows = {}
        for name, backend in variants.items():
            t0 = time.perf_counter()
            rows[name] = judge(model, ref, ids, decode, pool_bytes, backend)
            rows[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(model_type, name, rows[name], flush=True)
        return rows

    # (the Triton kernels need the real widths' head counts: on the CPU the floor alone runs)
    gpu = {} if dev.type == "cpu" else {"gpu (dispatch)": None, "triton": "triton"}
    variants = {**gpu, "torch bf16 (floor)": "reference"}
    out["dense_bf16"] = versus_reference(dense, variants)
    release = release_model(dense)
    del dense
    out["release"] = versus_reference(release, variants)
    return out


# ---- 3. the demo model -----------------------------------------------------------------------


def _padded(n: int) -> int:
    return -(-n // FP8_BLOCK) * FP8_BLOCK


@torch.no_grad()
def release_demo_model(out: str | Path, quantize: bool = True) -> Path:
    """The built-in demo model in the release's formats (FP8 linears with 128x128 ue8m0 blocks,
    FP4 experts with ue8m0 per 32, bf16 / fp32 the rest: deepseek_v4.tiny.save_release) in
    `out` (quantize=False: the same padded widths, dense fp32). The release quantizes
    activations per 128 values and needs 128-multiple inputs: the query rank (48) and the
    experts' width (80) are padded with zeros to 128, which computes the same function (zero
    weights, zero activations; the q norm's mean over 128 values instead of 48 is undone by
    scaling the two projections that read it by sqrt(48/128): only its eps moves, 1e-6 -> 2.7e-6
    of the mean square)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fam = models.family(DEMO_MODEL_DIR)
    raw = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    dense = fam.build_model(fam.ModelConfig.from_hf(raw), torch.float32, torch.device("cpu"))
    fam.load_weights(dense, DEMO_MODEL_DIR)
    q, inter = raw["q_lora_rank"], raw["moe_intermediate_size"]
    q_to, inter_to = _padded(q), _padded(inter)

    def pad(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith("attn.wq_a.weight") or name.endswith("attn.q_norm.weight"):
            return _pad_to(t, 0, q_to)  # [q, H] / [q] -> [q_to, ...]
        if name.endswith(("attn.wq_b.weight", "attn.indexer.wq_b.weight")):
            return _pad_to(t, 1, q_to) * math.sqrt(q / q_to)  # [N, q] -> [N, q_to]
        if name.endswith("experts.w13"):  # [E, gate | up, H] -> [E, gate | 0 | up | 0, H]
            gate, up = t.split(inter, dim=1)
            return torch.cat([_pad_to(gate, 1, inter_to), _pad_to(up, 1, inter_to)], dim=1)
        if name.endswith("experts.w2"):  # [E, H, inter] -> [E, H, inter_to]
            return _pad_to(t, 2, inter_to)
        if name.endswith(("shared_experts.w1.weight", "shared_experts.w3.weight")):
            return _pad_to(t, 0, inter_to)
        if name.endswith("shared_experts.w2.weight"):
            return _pad_to(t, 1, inter_to)
        return t

    tensors = {
        name: pad(name, t)
        for name, t in list(dense.named_parameters()) + list(dense.named_buffers())
        if not name.startswith("rope_tables.")
    }
    config = raw | {"q_lora_rank": q_to, "moe_intermediate_size": inter_to}
    if quantize:
        config |= {
            "expert_dtype": "fp4",
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            },
        }
        save_release(tensors, config, out)
    else:
        save_file(release_names(tensors, config), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return out


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t with zeros appended along `dim` up to `size`."""
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def demo_llm(model_dir: Path, device: str, dtype: str, quantized: bool | None, eager: bool) -> LLM:
    return LLM(
        model_dir,
        device=device,
        dtype=dtype,
        quantized_compute=quantized,
        enforce_eager=eager,
        max_num_batched_tokens=1024,
        max_num_seqs=16,
        kv_cache_memory_bytes=(1 << 30) if device == "cuda" else (64 << 20),
    )


@dataclass(frozen=True)
class DemoRun:
    path: Path
    device: str
    dtype: str
    quantized: bool | None  # None: the engine's default for the dtype
    backend: str | None = None  # kernels.use_backend for the whole run (None: the dispatch)
    judged_by: str | None = None  # the CPU run whose greedy tokens this one is held to


FP32_CPU = "fp32 CPU"
CPU_RELEASE = "release CPU fake-quant (fp32)"
CPU_RUNS = (FP32_CPU, "fp32 CPU, padded widths", "fp32 CPU, release weights dequantized")
GREEDY_REFERENCES = (FP32_CPU, CPU_RELEASE)  # whose greedy tokens a CPU record keeps


def demo_runs(tmp: Path, release_dir: Path, cpu: bool, gpu: bool) -> dict[str, DemoRun]:
    runs: dict[str, DemoRun] = {}
    if cpu:
        runs |= {
            FP32_CPU: DemoRun(DEMO_MODEL_DIR, "cpu", "float32", None),
            # the padding's own cost (none but the q norm's eps)
            "fp32 CPU, padded widths": DemoRun(
                release_demo_model(tmp / "padded", quantize=False), "cpu", "float32", None
            ),
            # the weights' formats alone: dequantized at load, activations not quantized
            "fp32 CPU, release weights dequantized": DemoRun(release_dir, "cpu", "float32", False),
            # and with the release's activation quantization: its whole arithmetic
            CPU_RELEASE: DemoRun(release_dir, "cpu", "float32", True),
        }
    if gpu:
        runs |= {
            "bf16 GPU": DemoRun(DEMO_MODEL_DIR, "cuda", "bfloat16", None, judged_by=FP32_CPU),
            "release GPU (bf16)": DemoRun(
                release_dir, "cuda", "bfloat16", True, judged_by=CPU_RELEASE
            ),
            # the floor: the release's arithmetic in plain torch, bf16, on the GPU (eager: the
            # reference experts read their routing back to the host)
            "release GPU, torch bf16 (floor)": DemoRun(
                release_dir, "cuda", "bfloat16", True, backend="reference", judged_by=CPU_RELEASE
            ),
        }
    return runs


def check_demo(dev: torch.device, smoke: bool, cpu_record: dict | None = None) -> dict:
    """Bits per byte of the demo model and its release-format conversion, CPU and (on a GPU
    run) GPU; each GPU run's greedy continuations held to its CPU twin's. cpu_record: the CPU
    half of an earlier run on the same windows (this phase's record from `--device cpu`), so a
    GPU lease need not spend its minutes on CPU scoring."""
    windows = heldout_windows(SMOKE_DEMO_WINDOWS if smoke else DEMO_WINDOWS)
    starts = [[BOS, *w[:64]] for w in heldout_windows(DEMO_PROMPTS, 256)]
    steps = 8 if smoke else DEMO_STEPS
    greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    out: dict = {"windows": len(windows), "window_bytes": len(windows[0]), "steps": steps}
    out["bpb"], out["greedy_tokens"] = {}, {}
    if cpu_record is not None:
        for key in ("windows", "window_bytes", "steps"):
            assert cpu_record[key] == out[key], (key, cpu_record[key], out[key])
        out["bpb"] = {k: cpu_record["bpb"][k] for k in (*CPU_RUNS, CPU_RELEASE)}
        out["greedy_tokens"] = {k: cpu_record["greedy_tokens"][k] for k in GREEDY_REFERENCES}
    with tempfile.TemporaryDirectory() as tmp:
        release_dir = release_demo_model(Path(tmp) / "release")
        runs = demo_runs(Path(tmp), release_dir, cpu_record is None, dev.type == "cuda")
        for name, run in runs.items():
            t0 = time.perf_counter()
            with kernels.use_backend(run.backend):
                llm = demo_llm(
                    run.path, run.device, run.dtype, run.quantized, run.backend is not None
                )
                out["bpb"][name] = bits_per_byte(llm.score, windows)
                if name in GREEDY_REFERENCES or run.judged_by:
                    tokens = [r.token_ids for r in llm.generate(starts, greedy)]
                if name in GREEDY_REFERENCES:
                    out["greedy_tokens"][name] = tokens
                if run.judged_by:
                    want = out["greedy_tokens"][run.judged_by]
                    out[f"{name} vs {run.judged_by}"] = _agreement(llm, starts, want, tokens)
            llm.close()
            print(f"demo {name}: {out['bpb'][name]:.4f} bpb ({time.perf_counter() - t0:.0f} s)")
    bpb = out["bpb"]
    out["rel_to_fp32_cpu"] = {k: v / bpb[FP32_CPU] - 1 for k, v in bpb.items()}
    if "release GPU (bf16)" in bpb:
        out["release_gpu_vs_cpu_fake_quant"] = bpb["release GPU (bf16)"] / bpb[CPU_RELEASE] - 1
    return out


def _agreement(llm: LLM, starts: list, want: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy continuations against the reference's: equal share, first divergence, the argmax
    given the reference's prefix (no cascade after one near-tie), and where that argmax differs
    how far the reference's token lies behind it in these logits (a near-tie: a small gap)."""
    same = total = 0
    gaps: list[float] = []
    for prompt, seq in zip(starts, want, strict=True):
        logits = llm.score([*prompt, *seq[:-1]]).float().cpu()[len(prompt) - 1 :]  # [len, V]
        wanted = torch.tensor(seq)
        hit = logits.argmax(-1) == wanted
        same += int(hit.sum())
        total += len(seq)
        miss = (~hit).nonzero().flatten()
        gaps += (logits[miss].max(-1).values - logits[miss, wanted[miss]]).tolist()
    return {
        "greedy_agreement": greedy_agreement(got, want),
        "first_divergence": [
            next((i for i, (x, y) in enumerate(zip(g, w, strict=True)) if x != y), len(w))
            for g, w in zip(got, want, strict=True)
        ],
        "teacher_forced_agreement": same / total,
        "teacher_forced_misses_logit_gap": sorted(round(g, 4) for g in gaps),
    }


# ---- the run ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny widths")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu (without --smoke): the demo phase's CPU half at full size, for --cpu-record",
    )
    parser.add_argument(
        "--cpu-record",
        help="a --device cpu run's JSON: the demo phase takes its CPU half from there",
    )
    parser.add_argument(
        "--only", nargs="+", choices=("kernels", "slice", "demo"), help="run only these phases"
    )
    args = parser.parse_args()
    dev = torch.device("cpu" if args.smoke else args.device)
    if dev.type == "cpu" and not args.smoke:
        args.only = ["demo"]  # the kernels and slices at real widths need the GPU
    cpu_record = json.loads(Path(args.cpu_record).read_text())["demo"] if args.cpu_record else None
    result: dict = {
        **prologue(dev),
        "smoke": args.smoke,
        "errors": {},
    }

    def phase(name: str, fn: Callable[[], Any]) -> None:
        if args.only and name.split(" ")[0] not in args.only:
            return
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{result['errors'][name]}", flush=True)
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write_record(args.out, result, indent=1)

    # (the trained model first: the judge that means most, and the quickest on a GPU)
    phase("demo", lambda: check_demo(dev, args.smoke, cpu_record))
    phase("kernels act_quant", lambda: check_act_quant(dev, args.smoke))
    phase("kernels linears", lambda: check_linears(dev, args.smoke))
    phase("kernels experts", lambda: check_experts(dev, args.smoke))
    phase("slice v4", lambda: check_slice(V4, dev, args.smoke))
    phase("slice v32", lambda: check_slice(V32, dev, args.smoke))
    print_summary(result)


def print_summary(result: dict) -> None:
    print(f"\n{result['device']}; failed phases: {sorted(result['errors']) or 'none'}")
    if "kernels act_quant" in result:
        print("act_quant:", result["kernels act_quant"])
    for key in ("kernels linears", "kernels experts"):
        for r in result.get(key, []):
            where = r.get("layer", "") + (f" M={r['M']}" if "M" in r else f" T={r['tokens']}")
            print(
                f"  {r['kernel']:28s} {r.get('model', ''):13s} {where:20s} "
                f"rel {r['rel_err']:.2e}  max {r['max_row_bf16_ulps']:.2f} bf16 ulps of the row"
            )
    for key in ("slice v4", "slice v32"):
        if key not in result:
            continue
        s = result[key]
        print(f"\n{key}: layers {s['layers']}, prompt {s['prompt']} tokens")
        for weights in ("dense_bf16", "release"):
            for name, r in s[weights].items():
                print(
                    f"  {weights:10s} {name:20s} forced {r['prompt_per_layer']} "
                    f"logits {r['prompt_logits']:.4f}; decode max {r['decode_per_layer_max']} "
                    f"logits {r['decode_logits_max']:.4f}; free {r['free_running_per_layer']} "
                    f"logits {r['free_running_logits']:.4f}; argmax same {r['argmax_agrees']}"
                )
    if "demo" in result:
        d = result["demo"]
        print(f"\ndemo bits per byte ({d['windows']} held-out windows of {d['window_bytes']} B):")
        for name, v in d["bpb"].items():
            print(f"  {name:32s} {v:.4f}  ({d['rel_to_fp32_cpu'][name] * 100:+.2f}% vs fp32 CPU)")
        for k, v in d.items():
            if " vs " in k and isinstance(v, dict):
                gaps = v["teacher_forced_misses_logit_gap"]
                print(
                    f"  {k}: teacher-forced argmax {v['teacher_forced_agreement']:.3f} "
                    f"(misses' logit gap max {max(gaps, default=0):.3f}), free-running greedy "
                    f"{v['greedy_agreement']:.3f}, first divergence {v['first_divergence']}"
                )


if __name__ == "__main__":
    main()
