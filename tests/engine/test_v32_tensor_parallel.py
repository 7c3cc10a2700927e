"""DeepSeek-V3.2 over two ranks (processes over gloo) against one: query heads by rank, the latent
row and the indexer whole on every rank, routed experts in ranges, dense MLPs and shared experts
by their intermediate dim, the vocabulary in halves. In fp32 the two ranks compute what one
computes up to the order of a few fp32 sums; the loader reads exactly each rank's slice."""

from __future__ import annotations

import re

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model
from dsaserve.engine.models.deepseek_v32.weights import build_model, load_weights
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import byte_ids

pytestmark = pytest.mark.e2e  # engines of two ranks, each rank a process

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=37, page_size=8, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("v32_release"), fmt="release")


@pytest.mark.parametrize("fmt", ["dense", "release"])
def test_two_ranks_compute_what_one_computes_in_fp32(fmt, release, tmp_path):
    model = release if fmt == "release" else make_tiny_model(tmp_path)
    prompts = [byte_ids(n, n) for n in (1, 12, 70, 130)]
    ids = byte_ids(160, 7)
    one = LLM(model, **ENGINE)
    want_tokens = [r.token_ids for r in one.generate(prompts, GREEDY)]
    want_logits = one.score(ids)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as two:
        assert [r.token_ids for r in two.generate(prompts, GREEDY)] == want_tokens
        assert rel_err(two.score(ids), want_logits) < 1e-5
        # the latent row is whole on every rank: a page means the same bytes at any size
        assert two.engine.pool.layout_hash() == one.engine.pool.layout_hash()


@pytest.mark.parametrize("quantized", [False, True])
def test_each_rank_loads_exactly_its_slice_of_every_weight(release, quantized):
    """No process group needed: the loader reads only the rank's coordinates (of the FP8
    weights kept, or dequantized and then cut)."""
    model = release
    cfg = ModelConfig.from_dir(model)
    dtype = torch.bfloat16 if quantized else torch.float32
    whole = build_model(cfg, dtype, torch.device("cpu"), quantized)
    load_weights(whole, model)
    full = whole.state_dict()
    split = set()
    for rank in range(2):
        part = build_model(cfg, dtype, torch.device("cpu"), quantized, TensorParallel(rank, 2))
        load_weights(part, model)
        for name, got in part.state_dict(keep_vars=True).items():
            want = full[name]
            if hasattr(got, "tp_dim"):
                want = want.chunk(2, got.tp_dim)[rank]
            elif hasattr(got, "tp_experts"):
                want = want[slice(*got.tp_experts)]
            if want.shape != full[name].shape:
                split.add(re.sub(r"^(layers|mtp)\.\d+\.", "", name))
            # bytes, so FP8 codes and e8m0 scales compare exactly too
            assert torch.equal(
                got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            ), (rank, name)
    # exactly these are split; the rest (wq_a, wkv_a, the norms, the indexer, the router) is whole
    heads = ["attn.wq_b.weight", "attn.wkv_b", "attn.wo.weight"]
    mlps = [f"ffn.{mlp}w{i}.weight" for mlp in ("", "shared_experts.") for i in (1, 2, 3)]
    scales = [n.replace(".weight", ".scale") for n in heads + mlps if "wkv_b" not in n]
    scales += ["ffn.experts.s13", "ffn.experts.s2"]  # the FP8 experts' block scales
    assert split == {
        "embed.weight", "head.weight", "ffn.experts.w13", "ffn.experts.w2",
        *heads, *mlps, *(scales if quantized else []),
    }  # fmt: skip
