"""The engine on a GPU (bf16, Triton kernels, CUDA graphs), against its own CPU fp32 path."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model
from tests.kernels_cases import gpu_test


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@gpu_test
def test_gpu_engine_scores_like_the_cpu_engine(tiny):
    ids = torch.randint(0, 262, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = LLM(tiny).score(ids)
    gpu = LLM(tiny, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20, max_num_seqs=16).score(ids)
    assert ((gpu.cpu() - cpu).norm() / cpu.norm()).item() < 5e-2


@gpu_test
def test_gpu_engine_generates_with_cuda_graphs(tiny):
    llm = LLM(tiny, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20, max_num_seqs=16)
    assert llm.engine.runner.graphs, "decode graphs should be captured on CUDA"
    prompts = ["Once upon a time", "0123456789" * 20, "x"]
    results = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [40, 40, 40]
    assert all(r.finish_reason == "length" for r in results)
    # The same prompts one by one (batch of one, another graph size) give the same tokens.
    alone = [llm.generate(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0] for p in prompts]
    agree = sum(a.token_ids == b.token_ids for a, b in zip(alone, results))
    assert agree >= 2, "bf16 batch-size effects may flip a near-tie, but not most sequences"
    free, total = llm.engine.kv_usage()
    assert free == total
