"""engine.sampler: each row draws from its own tempered, truncated distribution; a seeded row's
token depends on (seed, draw) and its logits alone."""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.sampler import sample
from dsaserve.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
DRAWS = 20_000


def _frequencies(params: SamplingParams) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = sample(LOGITS.expand(DRAWS, -1).clone(), [params] * DRAWS, [0] * DRAWS)
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / DRAWS


def test_plain_sampling_draws_from_the_tempered_softmax():
    for t in (0.5, 1.0, 2.0):
        want = torch.softmax(LOGITS / t, dim=0)
        got = _frequencies(SamplingParams(temperature=t))
        assert torch.allclose(got, want, atol=0.015), (t, got, want)


def test_top_k_and_top_p_renormalize_over_their_set():
    probs = torch.softmax(LOGITS, dim=0)
    order = probs.argsort(descending=True)
    top3 = torch.zeros_like(probs)
    top3[order[:3]] = probs[order[:3]]
    got = _frequencies(SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(got, top3 / top3.sum(), atol=0.015)
    # top_p 0.8: the smallest prefix of the sorted distribution whose mass reaches 0.8
    keep = (probs[order].cumsum(0) - probs[order]) < 0.8
    nucleus = torch.zeros_like(probs)
    nucleus[order[keep]] = probs[order[keep]]
    got = _frequencies(SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(got, nucleus / nucleus.sum(), atol=0.015)


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    for seeded in (
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=5),
    ):
        others = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams()]
        for draw in range(5):
            alone = sample(logits[1:2].clone(), [seeded], [draw])
            batched = sample(logits.clone(), [others[0], seeded, *others[1:]], [9, draw, 2, 0])
            assert alone.item() == batched[1].item()
        assert len({sample(logits[1:2].clone(), [seeded], [d]).item() for d in range(20)}) > 1


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0)]
    tokens = sample(logits.clone(), params, [0, 0, 0])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_tiny_temperatures_are_greedy_and_non_finite_ones_refused():
    logits = torch.tensor([[1.0, 5.0, 0.0, float("-inf")]])
    # logits / 1e-39 overflow to inf: the first infinity would win, not the likeliest token
    assert sample(logits.clone(), [SamplingParams(temperature=1e-39)], [0]).item() == 1
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be finite"):
            SamplingParams(temperature=bad)
