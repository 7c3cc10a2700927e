"""The engine's models against HF transformers on random checkpoints, in fp32: each family's
(DeepSeek-V4, DeepSeek-V3.2) in HF's names, scored whole and in chunks and decoded greedily in
mixed batches; then DeepSeek-V3.2's release FP8 layout against HF on the dequantized weights,
also under the release's own names (V4's release layout: test_release_parity.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.compare import rel_err
from dsaserve.engine.layers.experts import Fp8Experts
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.kernels.quant import dequantize_fp8_blocks
from tests.hf_reference import hf_greedy, hf_logits
from tests.model_fixtures import Family, families

pytestmark = pytest.mark.e2e  # the whole model against HF transformers

POOL = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _v4_mixed() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 70, 9, 150, 33, 1, 120, 17, 64, 5, 99, 41]
    return [torch.randint(0, 262, (n,), generator=gen).tolist() for n in lengths]


@dataclass(frozen=True)
class Case:
    seq: int  # tokens scored against HF's logits
    mixed: Callable[[], list[list[int]]]  # prompts of mixed lengths decoded in one batch
    mixed_tokens: int  # greedy tokens of each


CASES = {
    # CSA: 40 compressed entries > index_topk 8; HCA (rate 16): 10 entries. Twelve prompts,
    # some long enough for the indexer to select.
    "deepseek_v4": Case(160, _v4_mixed, 32),
    # every layer's indexer picks 8 of up to 100 tokens; prompts some shorter and some far
    # longer than index_topk
    "deepseek_v32": Case(100, lambda: [ids(n, 100 + n, 264) for n in (1, 70, 9, 120, 33, 5)], 24),
}


@pytest.fixture(scope="module")
def checkpoint(family: Family, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"hf_{family}")
    return path, family.hf.make_hf_checkpoint(path, seed=1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], **POOL)


@families()
def test_full_sequence_logits_match_hf(family, checkpoint, llm):
    token_ids = ids(CASES[family.name].seq, 7, family.hf.VOCAB)
    err = rel_err(llm.score(token_ids), hf_logits(checkpoint[1], token_ids))
    assert err < 1e-4, err


@families()
def test_chunked_scoring_matches_hf(family, checkpoint):
    """Chunks of 37 rows cut windows, compressor windows and pages at odd places; later chunks'
    queries pick among rows earlier steps wrote."""
    chunked = LLM(checkpoint[0], **{**POOL, "max_num_batched_tokens": 37})
    token_ids = ids(CASES[family.name].seq, 8, family.hf.VOCAB)
    err = rel_err(chunked.score(token_ids), hf_logits(checkpoint[1], token_ids))
    assert err < 1e-4, err


@families()
def test_batch_of_mixed_prompts_matches_hf_greedy_per_prompt(family, checkpoint, llm):
    """Prompts of mixed lengths decoded in one batch: each continuation is HF's greedy one
    through its own cache."""
    case = CASES[family.name]
    prompts = case.mixed()
    n = case.mixed_tokens
    results = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(checkpoint[1], prompt, n), f"prompt of {len(prompt)}"
        assert res.finish_reason == "length"


# ---------------------------------------------------------------- DeepSeek-V4's own


@families("deepseek_v4")
@pytest.mark.parametrize("prompt_len", [1, 15, 63, 130])
def test_greedy_continuation_matches_hf(family, checkpoint, llm, prompt_len):
    prompt = ids(prompt_len, prompt_len, family.hf.VOCAB)
    [res] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert res.token_ids == hf_greedy(checkpoint[1], prompt, 40)
    assert res.finish_reason == "length"


# ---------------------------------------------------------------- DeepSeek-V3.2's own


V32_TOKENS = 264  # the release tiny model's tokenizer; the head has padded rows past it


@pytest.fixture(scope="module")
def release_and_hf(family: Family, tmp_path_factory):
    """The tiny checkpoint in the published FP8 layout (seed 3), and HF's model of its weights."""
    path = family.make_tiny_model(tmp_path_factory.mktemp("v32_release"), seed=3, fmt="release")
    return path, family.hf.dequantized_hf_model(path, tmp_path_factory.mktemp("v32_dequantized"))


@families("deepseek_v32")
def test_release_layout_with_fp8_weights_matches_hf_on_the_dequantized_weights(release_and_hf):
    path, hf = release_and_hf
    llm = LLM(path, **POOL)  # fp32: the FP8 weights dequantized at load
    assert len(llm.engine.runner.model.mtp) == 1  # the MTP layer is loaded
    token_ids = ids(CASES["deepseek_v32"].seq, 9, V32_TOKENS)
    got, want = llm.score(token_ids)[:, :V32_TOKENS], hf_logits(hf, token_ids)[:, :V32_TOKENS]
    err = rel_err(got, want)
    assert err < 1e-4, err
    prompts = [ids(n, 200 + n, V32_TOKENS) for n in (4, 90, 17)]
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 16, vocab=V32_TOKENS), f"prompt {len(prompt)}"


@families("deepseek_v32")
def test_release_names_load_as_the_hf_names_do(family, release_and_hf, tmp_path):
    """The same checkpoint renamed as the release's convert.py writes it (`layers.N.attn.wq_a`,
    `.scale`, `ffn.gate.bias`; the MTP layer dropped) gives the same logits."""
    from dsaserve.engine.models.deepseek_v32.weights import canonical_name

    path, _ = release_and_hf
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    renamed = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = canonical_name(key.replace(".weight_scale_inv", ".weight"), layers)
                if name.startswith("mtp."):
                    continue
                if key.endswith(".weight_scale_inv"):
                    name = name.removesuffix(".weight") + ".scale"
                elif name.endswith(".attn.wkv_b"):
                    name += ".weight"
                renamed[name] = f.get_tensor(key)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / file, tmp_path / file)
    save_file(renamed, tmp_path / "model.safetensors")
    token_ids = ids(40, 11, V32_TOKENS)
    ours = LLM(tmp_path, **POOL).score(token_ids)
    assert torch.equal(ours, LLM(path, **POOL).score(token_ids))


@families("deepseek_v32")
def test_fp8_weights_kept_quantized_hold_the_checkpoints_codes_and_scales(family, release_and_hf):
    """Loaded for quantized compute (bfloat16), every FP8 linear and every routed expert holds
    the checkpoint's codes and its fp32 weight_scale_inv as ue8m0 scales: dequantized, exactly
    the fp32 model's weights (what the HF comparison above checked); the absorbed wkv_b is
    dense in both."""
    path, _ = release_and_hf
    models = family.package
    cfg = models.ModelConfig.from_dir(path)
    kept = models.build_model(cfg, torch.bfloat16, torch.device("cpu"), quantized=True)
    dense = models.build_model(cfg, torch.float32, torch.device("cpu"))
    models.load_weights(kept, path)
    models.load_weights(dense, path)
    linears = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    # 3 layers and the MTP layer: q_a, q_b, kv_a, o, the indexer's wq_b and wk; w1, w2, w3 of
    # the dense MLP or the shared experts
    assert len(linears) == 4 * (6 + 3)
    weights = dict(dense.named_parameters())
    for name, linear in linears.items():
        dequantized = dequantize_fp8_blocks(linear.weight, linear.scale)
        assert torch.equal(dequantized, weights[name + ".weight"]), name
    assert kept.layers[0].attn.wkv_b.dtype == torch.bfloat16
    experts = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Experts)}
    assert len(experts) == 3  # layers 1, 2 and the MTP layer
    for name, module in experts.items():
        for codes, scales in (("w13", "s13"), ("w2", "s2")):
            want = weights[f"{name}.{codes}"]
            for e in range(want.shape[0]):
                got = dequantize_fp8_blocks(getattr(module, codes)[e], getattr(module, scales)[e])
                assert torch.equal(got, want[e]), (name, codes, e)
