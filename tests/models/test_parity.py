"""The engine's models against HF transformers on random checkpoints in HF's names, in fp32, for
each family (DeepSeek-V4, DeepSeek-V3.2; DeepSeek-V4.1, which transformers lacks, against the
independent forward of tests/reference_v41.py on its tiny checkpoint): scored whole and in
chunks, decoded greedily in mixed batches. Then each family's own: V4's greedy continuations;
V4.1's chunked prefill with and without the prefix cache and its decoder layers trimmed to
their halo. (The release layouts: test_release_parity.py.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.models.deepseek_v41.block import Block as V41Block
from dsaserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, hf_logits
from tests.model_fixtures import Family, families

pytestmark = pytest.mark.e2e  # the whole model against HF transformers

POOL = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)
V41_LENGTHS = (1, 9, 40, 77, 130)


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
    # prompts shorter and far longer than the window (8), the top-k (8), the candidate blocks
    # (3 x 4) and the decoder's halos (22, 15, 8); ratio-2 pairs and Engram's n-grams cut by
    # the chunks
    "deepseek_v41": Case(150, lambda: [ids(n, 100 + n, 256) for n in V41_LENGTHS], 10),
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


# ---------------------------------------------------------------- DeepSeek-V4.1's own


@pytest.fixture(scope="module")
def v41_greedy(checkpoint) -> list[list[int]]:
    """The reference's greedy tokens of V4.1's mixed prompts."""
    case = CASES["deepseek_v41"]
    return [hf_greedy(checkpoint[1], p, case.mixed_tokens) for p in case.mixed()]


@families("deepseek_v41")
@pytest.mark.parametrize("chunk", [37, 8])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_chunked_prefill_with_and_without_the_prefix_cache(
    family, checkpoint, v41_greedy, chunk, prefix_cache
):
    """The mixed prompts prefilled in chunks of 37 or 8 rows (the decoder layers trimmed to
    their halo before each anchor); with the prefix cache (a checkpoint every 16 tokens) each
    prompt is sent twice, the second time resumed from the first's checkpoints: the reference's
    tokens each time."""
    case = CASES[family.name]
    llm = LLM(
        checkpoint[0],
        **{**POOL, "max_num_batched_tokens": chunk},
        enable_prefix_caching=prefix_cache,
        prefix_cache_checkpoint_interval=16,
    )
    greedy = SamplingParams(max_tokens=case.mixed_tokens, temperature=0, ignore_eos=True)
    for _ in range(2 if prefix_cache else 1):
        assert [r.token_ids for r in llm.generate(case.mixed(), greedy)] == v41_greedy
    if prefix_cache:
        assert llm.engine.prefix_cache is not None and llm.engine.prefix_cache.stats.hits > 0


@families("deepseek_v41")
def test_decoder_layers_compute_only_their_halo(family, checkpoint, v41_greedy):
    """A 130-token prompt prefilled without the prefix cache: the layers after the last KV
    source see only the rows of their halo before the prompt's end (the last layer its window),
    every earlier layer every row, and the tokens are still the reference's."""
    case = CASES[family.name]
    llm = LLM(checkpoint[0], **POOL, enable_prefix_caching=False)
    model, cfg = llm.engine.model, llm.engine.model_config
    rows: dict[int, list[int]] = {}
    hooks = [
        layer.attn.register_forward_hook(
            lambda m, args, out, i=i: rows.setdefault(i, []).append(args[0].shape[0])
        )
        for i, layer in enumerate(model.layers)
        if isinstance(layer, V41Block)
    ]
    greedy = SamplingParams(max_tokens=case.mixed_tokens, temperature=0, ignore_eos=True)
    try:
        assert llm.generate([case.mixed()[-1]], greedy)[0].token_ids == v41_greedy[-1]
    finally:
        for h in hooks:
            h.remove()
    prefill = {i: r[0] for i, r in rows.items()}  # (the first step: the whole prompt)
    last = cfg.last_kv_source
    assert all(prefill[i] == V41_LENGTHS[-1] for i in range(last + 1))
    assert [prefill[i] for i in range(last + 1, cfg.num_layers)] == [
        cfg.halo(i) for i in range(last + 1, cfg.num_layers)
    ]
    assert prefill[cfg.num_layers - 1] == cfg.sliding_window < V41_LENGTHS[-1]
