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

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, hf_logits
from tests.release_reference import (
    ENGINE,
    TOKENS,
    assert_layers_compute_the_release,
    dequantized_checkpoint,
    read_checkpoint,
    release_ids,
)

pytestmark = pytest.mark.e2e  # the whole release-format model against HF and the release

SEQ = 300  # HCA (rate 128): 2 entries; CSA (rate 4): 75 entries > index_topk 8


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
    return LLM(release, dtype="bfloat16", quantized_compute=True, **ENGINE)


def test_dequantized_logits_match_hf(hf, dequantized):
    ids = release_ids(SEQ, 7)
    # (score lists the tokenizer's vocabulary; HF's logits every row of the embedding)
    assert rel_err(dequantized.score(ids), hf_logits(hf, ids)[:, :TOKENS]) < 1e-4


@pytest.mark.parametrize("prompt_len", [1, 40, 290])
def test_dequantized_greedy_tokens_match_hf(hf, dequantized, prompt_len):
    prompt = release_ids(prompt_len, prompt_len)
    [res] = dequantized.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    assert res.token_ids == hf_greedy(hf, prompt, 24, vocab=TOKENS)


def test_quantized_layers_compute_the_release_arithmetic(quantized, raw):
    assert_layers_compute_the_release(quantized, raw)


def test_greedy_agreement_of_the_quantized_path(dequantized, quantized, release):
    """How often the release's arithmetic picks the token the dequantized fp32 model picks:
    top-1 over teacher-forced positions, and the greedy tokens before the first divergence,
    next to the same figures for plain bf16 (no FP8) to show the scale of the rounding. A
    random tiny model has small logit margins; FP8 activations (3 mantissa bits) move the
    logits by a few percent, so agreement is well below 100% but far above chance (1/264)."""
    bf16 = LLM(release, dtype="bfloat16", quantized_compute=False, **ENGINE)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [release_ids(n, n) for n in (1, 5, 17, 40, 77, 130, 200, 290)]
    reference = [r.token_ids for r in dequantized.generate(prompts, greedy)]
    report = {}
    for name, llm in (("quantized", quantized), ("bf16", bf16)):
        ids = [release_ids(SEQ, seed) for seed in range(4)]
        top1 = [
            (llm.score(x)[:, :TOKENS].argmax(-1) == dequantized.score(x)[:, :TOKENS].argmax(-1))
            .float()
            .mean()
            .item()
            for x in ids
        ]
        logits_err = rel_err(llm.score(ids[0]), dequantized.score(ids[0]))
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
