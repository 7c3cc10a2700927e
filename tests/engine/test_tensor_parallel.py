"""Tensor parallelism on the CPU: two ranks (processes over gloo) against one, on the tiny models.

fp32 (the dense model, and the release-format model dequantized at load): the two ranks compute
what one computes, up to the order of a few fp32 sums (wo_b's partial products, the experts'
ranges, the heads' batched matmuls): the same greedy tokens and logits within 1e-5. The release's
quantized arithmetic is checked where it can be exact, on the weights each rank loads (every
FP8 block, scale and FP4 expert is its slice of the checkpoint, bit for bit); end to end its
FP8 activations (3 mantissa bits) turn those fp32 reorderings into code flips, so two ranks
agree with one only within the scale of the quantization's own error.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.layers.experts import RoutedExperts
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.weights import build_model, load_weights
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import byte_ids
from tests.release_reference import ENGINE, TOKENS, release_ids

pytestmark = pytest.mark.e2e  # engines of two ranks, each rank a process

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEQ = 300  # CSA (rate 4): 75 entries > index_topk 8; HCA (rate 128 / 16): entries too
CHUNKED = dict(ENGINE, max_num_batched_tokens=37)  # chunks cut windows and pages at odd places


def _prompts() -> list[list[int]]:
    return [byte_ids(n, n) for n in (1, 9, 40, 130, 250)]


@pytest.mark.parametrize("fmt", ["dense", "release"])
def test_two_ranks_compute_what_one_computes_in_fp32(tiny, release, fmt):
    model = tiny if fmt == "dense" else release
    one = LLM(model, **CHUNKED)
    ids = byte_ids(SEQ, 7)
    want_tokens = [r.token_ids for r in one.generate(_prompts(), GREEDY)]
    want_logits = one.score(ids)
    with LLM(model, tensor_parallel_size=2, **CHUNKED) as two:
        followers = two.engine.followers.processes
        assert [r.token_ids for r in two.generate(_prompts(), GREEDY)] == want_tokens
        assert rel_err(two.score(ids), want_logits) < 1e-5
        # a page means the same bytes at any tensor-parallel size
        assert two.engine.pool.layout_hash() == one.engine.pool.layout_hash()
        with pytest.raises(RuntimeError, match="already runs in this process"):
            LLMEngine(model, EngineConfig(tensor_parallel_size=2))
    assert [p.exitcode for p in followers] == [0]  # stopped by close(), not killed


@pytest.mark.parametrize("quantized", [False, True])
def test_each_rank_loads_exactly_its_slice_of_every_weight(release, quantized):
    """No process group needed: the loader reads only the rank's coordinates."""
    cfg = ModelConfig.from_dir(release)
    dtype = torch.bfloat16 if quantized else torch.float32
    whole = build_model(cfg, dtype, torch.device("cpu"), quantized)
    load_weights(whole, release)
    full = dict(whole.named_parameters()) | dict(whole.named_buffers())
    split = set()
    for rank in range(2):
        part = build_model(cfg, dtype, torch.device("cpu"), quantized, TensorParallel(rank, 2))
        load_weights(part, release)
        for name, got in list(part.named_parameters()) + list(part.named_buffers()):
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
    # exactly these are split; the rest (the indexer, wkv, the shared expert, ...) is whole
    weights = ["attn.wq_b.weight", "attn.wo_b.weight", "ffn.experts.w13", "ffn.experts.w2"]
    scales = ["attn.wq_b.scale", "attn.wo_b.scale", "ffn.experts.s13", "ffn.experts.s2"]
    assert split == {
        "embed.weight", "head.weight", "attn.attn_sink", "attn.wo_a",
        *weights, *(scales if quantized else []),
    }  # fmt: skip


def test_dense_expert_ranges_add_up_to_all_experts():
    """Expert parallelism in the dense grouped-GEMM experts: ids outside a rank's range (given
    ids - start) are never computed and add nothing."""
    gen = torch.Generator().manual_seed(5)
    experts = RoutedExperts(6, 32, 16, limit=10.0)
    for p in experts.parameters():
        p.data.normal_(0, 0.3, generator=gen)
    x = torch.randn(40, 32, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=gen)
    parts = []
    for start, stop in ((0, 3), (3, 6)):
        half = RoutedExperts(stop - start, 32, 16, limit=10.0)
        half.load_state_dict({k: v[start:stop] for k, v in experts.state_dict().items()})
        parts.append(half(x, ids - start, weights))
    assert torch.equal(parts[0] + parts[1], experts(x, ids, weights))


def test_quantized_ranks_agree_within_the_quantizations_own_error(release):
    """bf16 with FP8 activations, FP8 GEMMs and FP4 experts, as the release computes."""
    quantized = dict(ENGINE, dtype="bfloat16", quantized_compute=True)
    sequences = [release_ids(SEQ, seed) for seed in range(2)]
    exact = [LLM(release, **ENGINE).score(x) for x in sequences]  # dequantized fp32
    one = [LLM(release, **quantized).score(x) for x in sequences]
    with LLM(release, tensor_parallel_size=2, **quantized) as llm:
        two = [llm.score(x) for x in sequences]
    for a, b, ref in zip(one, two, exact, strict=True):
        top1 = (a[:, :TOKENS].argmax(-1) == b[:, :TOKENS].argmax(-1)).float().mean().item()
        assert top1 > 0.75, top1  # measured 0.89; a mis-cut weight gives a different model
        assert rel_err(b, a) < rel_err(a, ref), (rel_err(b, a), rel_err(a, ref))


def _decode_on_a_group_of_two(model, engine: dict, prompt: list[int], params) -> list[int]:
    """The disaggregated decode path: a transfer fills rank 0's pools only (here a copy from a
    prefill engine's held pages, as the NIXL READ would); join hands every rank the KV. The
    tokens the two-rank decode engine generates."""
    prefill = LLMEngine(model, EngineConfig(**engine))
    prefill.add_request("r", prompt, params, prefill_only=True)
    outputs: list = []
    while not outputs:  # a long prompt prefills in several chunks
        outputs = prefill.step()
    [first] = outputs
    held = prefill.handoff.held_pages("r")
    decode = LLMEngine(model, EngineConfig(tensor_parallel_size=2, **engine))
    try:
        assert decode.pool.layout_hash() == prefill.pool.layout_hash()
        pages = decode.handoff.reserve("r", prompt, first.new_token_ids[0], params)
        for src, dst in zip(prefill.pool.regions(), decode.pool.regions(), strict=True):
            if src.group in held.pages:  # (its pages, not staging blocks: it was not staged)
                dst.tensor[pages.pages[dst.group]] = src.tensor[held.pages[src.group]]
        decode.handoff.join("r")
        tokens = list(first.new_token_ids)
        while decode.has_unfinished():
            tokens += [t for out in decode.step() for t in out.new_token_ids]
    finally:
        decode.close()
    return tokens


def test_a_decode_group_shares_the_kv_its_rank_0_received(tiny):
    prompt, params = byte_ids(90, 3), SamplingParams(max_tokens=16, temperature=0)
    want = LLM(tiny, **ENGINE).generate(prompt, params)[0].token_ids
    assert _decode_on_a_group_of_two(tiny, ENGINE, prompt, params) == want


def test_an_fp8_decode_group_shares_the_fp8_pages_its_rank_0_received():
    """--kv-cache-dtype fp8 (on the demo model, whose 512-wide rows the format needs): every
    rank builds the same FP8 pools, and join broadcasts rank 0's pulled uint8 pages as they are,
    so two ranks decode what one does."""
    fp8 = dict(
        kv_cache_dtype="fp8",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=32 << 20,
    )
    prompt, params = byte_ids(150, 5), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(DEMO_MODEL_DIR, **fp8).generate(prompt, params)[0].token_ids
    assert _decode_on_a_group_of_two(DEMO_MODEL_DIR, fp8, prompt, params) == want


def test_splits_the_model_cannot_take_are_refused_before_any_rank_starts(tiny, release):
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by 3"):
        LLMEngine(tiny, EngineConfig(tensor_parallel_size=3))
    # FP8 weights kept quantized split only on their 128 x 128 block grid; dequantized, anywhere
    narrow = dataclasses.replace(ModelConfig.from_dir(release), o_lora_rank=64)
    narrow.check_tensor_parallel(2, fp8=False)
    with pytest.raises(ConfigError, match=r"wo_b's input .* \(64 per rank\) .* FP8 block"):
        narrow.check_tensor_parallel(2, fp8=True)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")
