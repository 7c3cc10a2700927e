"""The engine's models against HF transformers on random checkpoints in HF's names, in fp32, for
each family (DeepSeek-V4, DeepSeek-V3.2): scored whole and in chunks, decoded greedily in mixed
batches. (The release layouts against HF: test_release_parity.py.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
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
