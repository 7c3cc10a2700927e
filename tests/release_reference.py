"""An independent reading of the DeepSeek-V4 release's checkpoint formats and arithmetic (tests).

Decodes the checkpoint's raw bytes from their bit layouts (e4m3: sign, 4-bit exponent biased by
7, 3-bit mantissa; ue8m0: 2^(byte - 127); e2m1 by the release convert.py's FP4_TABLE, the low
nibble first) in float64, without torch's float8 casts and without kernels.quant, and restates
the release's `linear()` (inference/model.py: act_quant, then fp8_gemm / fp4_gemm to bf16) and
`Expert.forward` (SwiGLU in fp32, the routing weight before w2) on those values.
`assert_layers_compute_the_release` holds an engine's quantized layers to them (CPU and GPU
tests share it; no HF transformers needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from bench.compare import rel_err
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.sampling_params import SamplingParams

_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_TABLE = _MAGNITUDES + tuple(-v for v in _MAGNITUDES)  # codes 8-15: sign bit set (-0.0 too)
SCALE_SUFFIX = ".scale"
TOKENS = 264  # the release tiny model's tokenizer (its vocabulary has 384 rows)
ENGINE = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)


def release_ids(n: int, seed: int) -> list[int]:
    """n random token ids of the release tiny model's tokenizer."""
    return torch.randint(0, TOKENS, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, as stored."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    bits = codes.view(torch.uint8).long()
    sign = 1.0 - 2.0 * (bits >> 7).double()
    exp, man = (bits >> 3) & 15, (bits & 7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    subnormal = man / 8 * 2.0**-6
    return sign * torch.where(exp == 0, subnormal, normal)  # (the release never stores NaN)


def ue8m0_values(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, (scale.view(torch.uint8).long() - 127).double())


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_TABLE, dtype=torch.float64)
    u8 = packed.view(torch.uint8).long()
    return torch.stack((table[u8 & 15], table[u8 >> 4]), dim=-1).flatten(-2)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [out, in] of an FP8 (128x128 blocks) or FP4 (1x32 groups) weight."""
    s = ue8m0_values(scale)
    if codes.dtype == torch.float8_e4m3fn:
        n, k = codes.shape
        s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return e4m3_values(codes) * s
    return fp4_values(codes) * s.repeat_interleave(32, -1)


def dequantized_checkpoint(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Release names -> fp32 values, quantized weights dequantized and their scales dropped."""
    out = {}
    for name, t in raw.items():
        stem = name.removesuffix(".weight")
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) + ".weight" in raw:
            continue
        if stem + SCALE_SUFFIX in raw and name.endswith(".weight"):
            out[name] = dequantize(t, raw[stem + SCALE_SUFFIX]).float()
        else:
            out[name] = t if t.dtype == torch.int64 else t.float()
    return out


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """The release's act_quant (per 128 values, ue8m0 scale), returned dequantized in float64."""
    groups = x.float().unflatten(-1, (-1, 128))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    # scale = 2^ceil(log2(amax * fp32(1/448))), the product in fp32 as the release forms it
    mantissa, exponent = torch.frexp(amax * torch.tensor(1 / 448, dtype=torch.float32))
    scale = torch.pow(2.0, (exponent - (mantissa == 0.5).int()).double())
    codes = (groups.double() / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return (e4m3_values(codes) * scale).flatten(-2)


def release_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear() on a quantized weight (given dequantized, float64 [out, in]) -> bf16."""
    return (act_quant(x) @ weight.double().t()).float().to(torch.bfloat16)


def release_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    limit: float,
) -> torch.Tensor:
    """MoE.forward's routed-expert loop with Expert.forward -> fp32 [T, hidden]."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(expert_ids).tolist():
        tok, slot = torch.where(expert_ids == e)
        gate = release_linear(x[tok], w1[e]).float().clamp(max=limit)
        up = release_linear(x[tok], w3[e]).float().clamp(-limit, limit)
        h = weights[tok, slot, None].float() * (F.silu(gate) * up)
        y[tok] += release_linear(h.to(x.dtype), w2[e]).float()
    return y


def _dequantized(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return dequantize(raw[f"{name}.weight"], raw[f"{name}.scale"])


def _emulate(model, raw, name: str, args: list[torch.Tensor]) -> torch.Tensor:
    """What the release computes for one call of the quantized layer `name`."""
    if not name.endswith(".experts"):
        return release_linear(args[0], _dequantized(raw, name))
    module = model.get_submodule(name)
    experts = range(module.w13.shape[0])
    w1, w3, w2 = (
        [_dequantized(raw, f"{name}.{e}.{w}") for e in experts] for w in ("w1", "w3", "w2")
    )
    return release_experts(*args, w1, w3, w2, module.limit)


def assert_layers_compute_the_release(llm: LLM, raw: dict[str, torch.Tensor]) -> None:
    """Record every quantized layer's input and output through a 300-token prefill and a few
    decode steps (eager: hooks see no graph replays), then hold each output to the emulation
    of the release on the same input: relative error < 2e-3. Both sides round an fp32 result
    to bf16, and sums that differ in their last fp32 bits round a bf16 ulp (2^-8) apart now and
    then: 1.06e-3 on the H200 for one layer; a wrong scale block or a missed clamp is >= 1e-2."""
    model, calls = llm.engine.model, []
    hooks = [
        module.register_forward_hook(
            lambda m, args, out, name=name: calls.append((name, [a.cpu() for a in args], out.cpu()))
        )
        for name, module in model.named_modules()
        if isinstance(module, (Fp8Linear, Fp4Experts))
    ]
    try:
        llm.score(release_ids(300, 11))
        llm.generate(release_ids(37, 12), SamplingParams(max_tokens=4, temperature=0))
    finally:
        for h in hooks:
            h.remove()
    kinds = {name.rsplit(".", 1)[-1] for name, _, _ in calls}
    assert kinds >= {"wq_a", "wq_b", "wkv", "wo_b", "w1", "w2", "w3", "experts"}, kinds
    errors: dict[str, float] = {}
    for name, args, got in calls:
        errors[name] = max(errors.get(name, 0.0), rel_err(got, _emulate(model, raw, name, args)))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 2e-3, (worst, errors[worst])
