"""engine.logprobs: each sampled token's raw logprob and its likeliest alternatives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsaserve.engine.llm import LLM
from dsaserve.engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from dsaserve.engine.sampling_params import SamplingParams


def test_one_batch_serves_rows_with_different_widths() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    logits[:, 40:] = float("-inf")  # a padded vocabulary: never listed
    tokens = [7, 3, 39, 0]
    counts = [2, None, 0, 5]
    out = read_logprobs(logprob_table(logits, torch.tensor(tokens), counts), counts)
    assert out[1] is None
    for b in (0, 2, 3):
        row = torch.log_softmax(logits[b].double(), dim=-1)
        expected = sorted(range(40), key=lambda i: -row[i].item())[: counts[b]]
        got = out[b]
        assert isinstance(got, TokenLogprobs)
        assert got.logprob == pytest.approx(row[tokens[b]].item(), abs=1e-5)
        assert list(got.top_ids) == expected
        assert got.top_logprobs == pytest.approx([row[i].item() for i in expected], abs=1e-5)
    none = [None] * 4
    assert logprob_table(logits, torch.tensor(tokens), none) is None
    assert read_logprobs(None, none) == none


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(tiny)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0, logprobs=4, ignore_eos=True),
        SamplingParams(
            max_tokens=12, temperature=0.7, top_k=5, seed=3, logprobs=2, ignore_eos=True
        ),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_are_the_raw_distribution_whatever_the_sampling(
    llm: LLM, params: SamplingParams
) -> None:
    prompt = llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    result = llm.generate(prompt, params)[0]
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    # One causal forward over prompt + output: the row before each output token predicts it.
    rows = torch.log_softmax(llm.score(prompt + result.token_ids).double(), dim=-1)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        row = rows[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(params.logprobs)
        assert list(lp.top_ids) == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        if params.greedy:
            assert lp.top_ids[0] == token
    assert llm.generate(prompt, SamplingParams(max_tokens=2))[0].logprobs is None


def test_prompt_logprobs_equal_the_prompts_score(tiny: Path) -> None:
    """vLLM's prompt_logprobs: each prompt token after the first, as one causal forward over the
    prompt scores it, also when the prompt is prefilled in chunks, and never resumed from the
    prefix cache (a prompt sent again computes every row again)."""
    llm = LLM(
        tiny,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    prompt = llm.tokenizer.encode(
        "It was the best of times, it was the worst", add_special_tokens=True
    )
    rows = torch.log_softmax(llm.score(prompt).double(), dim=-1)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for _ in range(2):  # the second time the prompt is in the prefix cache
        result = llm.generate([prompt, prompt[:5]], [params, SamplingParams(max_tokens=2)])
        lps = result[0].prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) - 1
        for j, lp in enumerate(lps):
            row = rows[j]
            assert lp.logprob == pytest.approx(row[prompt[j + 1]].item(), abs=1e-4)
            assert list(lp.top_ids) == row.topk(3).indices.tolist()
        assert result[1].prompt_logprobs is None
