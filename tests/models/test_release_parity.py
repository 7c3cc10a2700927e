"""The release-format checkpoint in the engine, for each family (DeepSeek-V4's FP8 linears and
FP4 experts with ue8m0 scales, DeepSeek-V3.2's FP8 weights with their fp32 power-of-two
weight_scale_inv), both ways it computes:

- dequantized at load (float32, the CPU default), each family's: against HF transformers' model
  (DeepseekV4ForCausalLM, DeepseekV32ForCausalLM) fed the independently dequantized weights,
  logits and greedy tokens, the MTP layer loaded;
- quantized (V4's own: the release's arithmetic, FP8 activations, block-scaled FP8 GEMMs, FP4
  experts): every quantized layer's output against an independent emulation of the release's
  linear() and Expert.forward on the same input, and how often its greedy choices agree with
  the dequantized model's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM, PreTrainedModel

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, hf_logits
from tests.hf_reference_v32 import dequantized_hf_model
from tests.model_fixtures import families
from tests.release_reference import (
    ENGINE,
    TOKENS,
    assert_layers_compute_the_release,
    dequantized_checkpoint,
    read_checkpoint,
    release_ids,
)

pytestmark = pytest.mark.e2e  # the whole release-format model against HF and the release

SEQ = 300  # V4: HCA (rate 128): 2 entries; CSA (rate 4): 75 entries > index_topk 8


def _v4_hf(release: Path, path: Path) -> PreTrainedModel:
    """An fp32 checkpoint under the release's names (tests/release_reference.py's decoding)."""
    save_file(dequantized_checkpoint(read_checkpoint(release)), path / "model.safetensors")
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (path / "config.json").write_text(json.dumps(config))
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Case:
    hf: Callable[[Path, Path], PreTrainedModel]  # HF's model of the dequantized weights
    seq: int  # tokens scored (seed `seed`)
    seed: int
    batches: tuple[tuple[int, ...], ...]  # prompt lengths decoded greedily, a batch per case
    prompt_seed: Callable[[int], int]  # of a prompt of that length
    max_tokens: int


CASES = {
    "deepseek_v4": Case(_v4_hf, SEQ, 7, ((1,), (40,), (290,)), lambda n: n, 24),
    # the indexer picks 8 of up to 100 tokens; three prompts in one batch
    "deepseek_v32": Case(dequantized_hf_model, 100, 9, ((4, 90, 17),), lambda n: 200 + n, 16),
}


@pytest.fixture(scope="module")
def raw(release):
    return read_checkpoint(release)


@pytest.fixture(scope="module")
def hf(family, release, tmp_path_factory):
    """HF's model on the dequantized weights."""
    return CASES[family.name].hf(release, tmp_path_factory.mktemp("hf_dequantized"))


@pytest.fixture(scope="module")
def dequantized(release):
    return LLM(release, **ENGINE)


@pytest.fixture(scope="module")
def quantized(release):
    return LLM(release, dtype="bfloat16", quantized_compute=True, **ENGINE)


@families()
def test_dequantized_logits_match_hf(family, hf, dequantized):
    case = CASES[family.name]
    assert len(dequantized.engine.runner.model.mtp) == 1  # the MTP layer is loaded
    ids = release_ids(case.seq, case.seed)
    # (score lists the tokenizer's vocabulary, or more; HF's logits every row of the embedding)
    err = rel_err(dequantized.score(ids)[:, :TOKENS], hf_logits(hf, ids)[:, :TOKENS])
    assert err < 1e-4, err


@pytest.mark.parametrize(
    "family, lengths",
    [(f, lengths) for f, case in CASES.items() for lengths in case.batches],
    ids=lambda v: v if isinstance(v, str) else ",".join(map(str, v)),
    indirect=["family"],
    scope="module",
)
def test_dequantized_greedy_tokens_match_hf(family, hf, dequantized, lengths):
    case = CASES[family.name]
    prompts = [release_ids(n, case.prompt_seed(n)) for n in lengths]
    greedy = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True)
    results = dequantized.generate(prompts, greedy)
    for prompt, res in zip(prompts, results, strict=True):
        want = hf_greedy(hf, prompt, case.max_tokens, vocab=TOKENS)
        assert res.token_ids == want, f"prompt of {len(prompt)}"


# ---------------------------------------------------------------- DeepSeek-V4's own


@families("deepseek_v4")
def test_quantized_layers_compute_the_release_arithmetic(quantized, raw):
    assert_layers_compute_the_release(quantized, raw)


@families("deepseek_v4")
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
