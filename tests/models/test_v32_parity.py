"""The engine's DeepSeek-V3.2 against HF transformers' DeepseekV32ForCausalLM, in fp32: a random
checkpoint in HF's names, and the release's FP8 layout (against HF on the dequantized weights),
also under the release's own names."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bench.compare import rel_err
from dsaserve.engine.layers.experts import Fp8Experts
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model
from dsaserve.engine.models.deepseek_v32.weights import build_model, canonical_name, load_weights
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.kernels.quant import dequantize_fp8_blocks
from tests.hf_reference import hf_greedy, hf_logits
from tests.hf_reference_v32 import VOCAB, dequantized_hf_model, make_hf_checkpoint

pytestmark = pytest.mark.e2e  # the whole model against HF transformers

SEQ = 100  # every layer's indexer picks 8 of up to 100 tokens
POOL = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)


def ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_v32")
    return path, make_hf_checkpoint(path, seed=1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], **POOL)


def test_full_sequence_logits_match_hf(checkpoint, llm):
    token_ids = ids(SEQ, 7)
    err = rel_err(llm.score(token_ids), hf_logits(checkpoint[1], token_ids))
    assert err < 1e-4, err


def test_chunked_scoring_matches_hf(checkpoint):
    """Chunks of 37 rows: later chunks' queries pick among rows earlier steps wrote."""
    chunked = LLM(checkpoint[0], **{**POOL, "max_num_batched_tokens": 37})
    token_ids = ids(SEQ, 8)
    err = rel_err(chunked.score(token_ids), hf_logits(checkpoint[1], token_ids))
    assert err < 1e-4, err


def test_batch_of_mixed_prompts_matches_hf_greedy_per_prompt(checkpoint, llm):
    """Prompts of mixed lengths, some shorter and some far longer than index_topk, decoded in
    one batch: each continuation is HF's greedy one through its own cache."""
    lengths = [1, 70, 9, 120, 33, 5]
    prompts = [ids(n, 100 + n) for n in lengths]
    results = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(checkpoint[1], prompt, 24), f"prompt of {len(prompt)}"
        assert res.finish_reason == "length"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny checkpoint in the published FP8 layout, and HF's model of its weights."""
    path = make_tiny_model(tmp_path_factory.mktemp("v32_release"), seed=3, fmt="release")
    return path, dequantized_hf_model(path, tmp_path_factory.mktemp("v32_dequantized"))


def test_release_layout_with_fp8_weights_matches_hf_on_the_dequantized_weights(release):
    path, hf = release
    llm = LLM(path, **POOL)  # fp32: the FP8 weights dequantized at load
    assert len(llm.engine.runner.model.mtp) == 1  # the MTP layer is loaded
    tokens = 264  # the tokenizer's; the head has padded rows past it
    token_ids = ids(SEQ, 9, tokens)
    err = rel_err(llm.score(token_ids)[:, :tokens], hf_logits(hf, token_ids)[:, :tokens])
    assert err < 1e-4, err
    prompts = [ids(n, 200 + n, tokens) for n in (4, 90, 17)]
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 16, vocab=tokens), f"prompt {len(prompt)}"


def test_release_names_load_as_the_hf_names_do(release, tmp_path):
    """The same checkpoint renamed as the release's convert.py writes it (`layers.N.attn.wq_a`,
    `.scale`, `ffn.gate.bias`; the MTP layer dropped) gives the same logits."""
    path, _ = release
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
    token_ids = ids(40, 11, 264)
    ours = LLM(tmp_path, **POOL).score(token_ids)
    assert torch.equal(ours, LLM(path, **POOL).score(token_ids))


def test_fp8_weights_kept_quantized_hold_the_checkpoints_codes_and_scales(release):
    """Loaded for quantized compute (bfloat16), every FP8 linear and every routed expert holds
    the checkpoint's codes and its fp32 weight_scale_inv as ue8m0 scales: dequantized, exactly
    the fp32 model's weights (what the HF comparison above checked); the absorbed wkv_b is
    dense in both."""
    path, _ = release
    cfg = ModelConfig.from_dir(path)
    kept = build_model(cfg, torch.bfloat16, torch.device("cpu"), quantized=True)
    dense = build_model(cfg, torch.float32, torch.device("cpu"))
    load_weights(kept, path)
    load_weights(dense, path)
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
