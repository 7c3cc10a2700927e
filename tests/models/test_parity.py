"""The engine's DeepSeek-V4 against HF transformers on random checkpoints, in fp32."""

from __future__ import annotations

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from tests.hf_reference import VOCAB, hf_greedy, hf_logits, make_hf_checkpoint

pytestmark = pytest.mark.e2e  # the whole model against HF transformers

SEQ = 160  # CSA: 40 compressed entries > index_topk 8; HCA (rate 16): 10 entries


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_v4")
    return path, make_hf_checkpoint(path, seed=1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(
        checkpoint[0], max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20
    )


def test_full_sequence_logits_match_hf(checkpoint, llm):
    _, hf = checkpoint
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(7)).tolist()
    err = rel_err(llm.score(ids), hf_logits(hf, ids))
    assert err < 1e-4, err


def test_chunked_scoring_matches_hf(checkpoint, tmp_path):
    """Chunks of 37 rows cut windows, compressor windows and pages at odd places."""
    path, hf = checkpoint
    chunked = LLM(path, max_num_batched_tokens=37, page_size=8, kv_cache_memory_bytes=64 << 20)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(8)).tolist()
    err = rel_err(chunked.score(ids), hf_logits(hf, ids))
    assert err < 1e-4, err


@pytest.mark.parametrize("prompt_len", [1, 15, 63, 130])
def test_greedy_continuation_matches_hf(checkpoint, llm, prompt_len):
    _, hf = checkpoint
    prompt = torch.randint(
        0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)
    ).tolist()
    [res] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert res.token_ids == hf_greedy(hf, prompt, 40)
    assert res.finish_reason == "length"


def test_batch_of_mixed_prompts_matches_hf_per_prompt(checkpoint, llm):
    """Twelve prompts of mixed lengths (some long enough for the indexer to select) in one batch."""
    _, hf = checkpoint
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 70, 9, 150, 33, 1, 120, 17, 64, 5, 99, 41]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    results = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} tokens"
