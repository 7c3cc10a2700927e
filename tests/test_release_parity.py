"""The release-format checkpoint in the engine, both ways it computes:

- dequantized at load (float32, the CPU default): against HF transformers' DeepseekV4ForCausalLM
  fed the independently dequantized weights, logits and greedy tokens;
- quantized (the release's arithmetic: FP8 activations, block-scaled FP8 GEMMs, FP4 experts):
  every quantized layer's output against an independent emulation of the release's linear() and
  Expert.forward on the same input, and how often its greedy choices agree with the dequantized
  model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM

from engine import LLM, SamplingParams
from engine.layers.fp8_linear import Fp8Linear
from engine.models.deepseek_v4.moe import Fp4Experts
from engine.models.deepseek_v4.tiny import make_tiny_model
from tests.hf_reference import hf_greedy, hf_logits
from tests.kernels_cases import gpu_test
from tests.release_reference import (
    dequantize,
    dequantized_checkpoint,
    read_checkpoint,
    release_experts,
    release_linear,
)

SEQ = 300  # HCA (rate 128): 2 entries; CSA (rate 4): 75 entries > index_topk 8
TOKENS = 264  # the release tiny model's tokenizer (its vocabulary has 384 rows)
ENGINE = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)
QUANTIZED = dict(dtype="bfloat16", quantized_compute=True, **ENGINE)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TOKENS, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("release"), fmt="release")


@pytest.fixture(scope="module")
def raw(release):
    return read_checkpoint(release)


@pytest.fixture(scope="module")
def hf(release, raw, tmp_path_factory):
    """HF's model on the dequantized weights: an fp32 checkpoint under the release's names."""
    path = tmp_path_factory.mktemp("hf_dequantized")
    save_file(dequantized_checkpoint(raw), path / "model.safetensors")
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (path / "config.json").write_text(json.dumps(config))
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dequantized(release):
    return LLM(release, **ENGINE)


@pytest.fixture(scope="module")
def quantized(release):
    return LLM(release, **QUANTIZED)


def test_dequantized_logits_match_hf(hf, dequantized):
    ids = _ids(SEQ, 7)
    assert _rel_err(dequantized.score(ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("prompt_len", [1, 40, 290])
def test_dequantized_greedy_tokens_match_hf(hf, dequantized, prompt_len):
    prompt = _ids(prompt_len, prompt_len)
    [res] = dequantized.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    assert res.token_ids == hf_greedy(hf, prompt, 24, vocab=TOKENS)


def _dequantized(raw, name: str) -> torch.Tensor:
    return dequantize(raw[f"{name}.weight"], raw[f"{name}.scale"])


def _release_outputs(model, raw, calls) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(layer, engine output, emulated output) for each recorded call of a quantized layer."""
    out = []
    for name, args, got in calls:
        args = [a.cpu() for a in args]
        if name.endswith(".experts"):
            module = model.get_submodule(name)
            experts = range(module.w13.shape[0])
            w1, w3, w2 = (
                [_dequantized(raw, f"{name}.{e}.{w}") for e in experts] for w in ("w1", "w3", "w2")
            )
            want = release_experts(*args, w1, w3, w2, module.limit)
        else:
            want = release_linear(args[0], _dequantized(raw, name))
        out.append((name, got.cpu(), want))
    return out


def _check_quantized_layers(llm: LLM, raw) -> None:
    """Record every quantized layer's input and output through a prefill and a few decode
    steps, then hold each output to the emulation of the release on the same input."""
    model, calls = llm.engine.model, []
    hooks = [
        module.register_forward_hook(
            lambda m, args, out, name=name: calls.append((name, [a.clone() for a in args], out))
        )
        for name, module in model.named_modules()
        if isinstance(module, (Fp8Linear, Fp4Experts))
    ]
    try:
        llm.score(_ids(SEQ, 11))
        llm.generate(_ids(37, 12), SamplingParams(max_tokens=4, temperature=0))
    finally:
        for h in hooks:
            h.remove()
    kinds = {name.rsplit(".", 1)[-1] for name, _, _ in calls}
    assert kinds >= {"wq_a", "wq_b", "wkv", "wo_b", "w1", "w2", "w3", "experts"}, kinds
    errors = {}
    for name, got, want in _release_outputs(model, raw, calls):
        errors[name] = max(errors.get(name, 0.0), _rel_err(got, want))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-3, (worst, errors[worst])


def test_quantized_layers_compute_the_release_arithmetic(quantized, raw):
    _check_quantized_layers(quantized, raw)


@gpu_test
def test_quantized_layers_on_the_gpu_compute_the_release_arithmetic(release, raw):
    """The Triton kernels (act_quant, FP8 GEMM with and without fused quantization, FP4 MoE),
    eager so that the hooks see every step."""
    _check_quantized_layers(LLM(release, device="cuda", enforce_eager=True, **QUANTIZED), raw)


def test_greedy_agreement_of_the_quantized_path(dequantized, quantized, release):
    """How often the release's arithmetic picks the token the dequantized fp32 model picks:
    top-1 over teacher-forced positions, and the greedy tokens before the first divergence,
    next to the same figures for plain bf16 (no FP8) to show the scale of the rounding. A
    random tiny model has small logit margins; FP8 activations (3 mantissa bits) move the
    logits by a few percent, so agreement is well below 100% but far above chance (1/264)."""
    bf16 = LLM(release, dtype="bfloat16", quantized_compute=False, **ENGINE)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [_ids(n, n) for n in (1, 5, 17, 40, 77, 130, 200, 290)]
    reference = [r.token_ids for r in dequantized.generate(prompts, greedy)]
    report = {}
    for name, llm in (("quantized", quantized), ("bf16", bf16)):
        ids = [_ids(SEQ, seed) for seed in range(4)]
        top1 = [
            (llm.score(x)[:, :TOKENS].argmax(-1) == dequantized.score(x)[:, :TOKENS].argmax(-1))
            .float()
            .mean()
            .item()
            for x in ids
        ]
        logits_err = _rel_err(llm.score(ids[0]), dequantized.score(ids[0]))
        runs = [r.token_ids for r in llm.generate(prompts, greedy)]
        prefix = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(runs, reference, strict=True)
        ]
        report[name] = (sum(top1) / len(top1), sum(prefix) / len(prefix), logits_err)
    for name, (top1, prefix, err) in report.items():
        print(
            f"\n{name} vs dequantized fp32: top-1 agreement {top1:.1%} over {4 * SEQ} positions,"
            f" {prefix:.1f} of 32 greedy tokens equal before the first divergence,"
            f" logits rel. error {err:.3f}"
        )
    assert report["quantized"][0] > 0.4  # chance would be 0.4%
