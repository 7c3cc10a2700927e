"""Which drafts a target step accepts: greedy exactly, sampled requests by rejection sampling.

A request that verifies m drafts d_1..d_m has m + 1 logit rows: row j scores the position of
d_{j+1} (row m the bonus position). With p_j the distribution the sampler draws row j from
(engine.sampler.probabilities: temperature, top-k, top-p; one-hot for greedy) and a draft that
is one token (the MTP layer's argmax, q = one-hot), the standard rule accepts d_{j+1} with
probability min(1, p_j(d) / q(d)) = p_j(d_{j+1}); the first rejected row j instead emits a
token drawn from the residual max(0, p_j - q) = p_j without d_{j+1}, renormalized; when all m
are accepted the bonus row emits a token drawn from p_m. Each emitted token then follows the
target distribution exactly, and a greedy row accepts exactly when its argmax equals the draft,
so greedy requests keep their tokens token for token.

Row j's randomness (its acceptance coin and its residual draw) comes, for a seeded request,
from generators seeded with (seed, output index of the token it may emit) alone, so seeded
requests reproduce whatever batch they share.
"""

from __future__ import annotations

import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.sampler import _generator, _noise, probabilities
from dsaserve.engine.sampling_params import SamplingParams

_COIN = 0x5DEECE66D  # sets the acceptance coins' seeds apart from the draws'


def verify_rows(
    logits: torch.Tensor,
    drafts: list[int],
    params: list[SamplingParams],
    draws: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] fp32: every verified row of a step; drafts[r]: the draft row r scores (-1
    on a bonus row); params, draws: row r's request's and the output index of its token.
    Returns (accepted [R] bool: row r's draft passed, the token row r emits [R] int64: its draft
    where accepted, else what it emits if it is the first that fails, or the bonus row), on the
    device."""
    dev = logits.device
    probs = probabilities(logits, params)  # [R, V]
    draft = to_device(drafts, torch.int64, dev)
    has = draft >= 0
    p_draft = probs.gather(1, draft.clamp(min=0)[:, None]).squeeze(1) * has
    accepted = _coins(params, draws, dev) < p_draft
    residual = probs.masked_fill(
        torch.nn.functional.one_hot(draft.clamp(min=0), probs.shape[1]).bool() & has[:, None], 0.0
    )
    greedy = to_device([p.greedy for p in params], torch.bool, dev)
    noise = _noise((residual.shape[0], residual.shape[1]), params, draws, dev)
    # exponential race: argmax(w / E) is w-distributed; a greedy row keeps its argmax
    tokens = torch.where(greedy, residual.argmax(dim=-1), (residual / noise).argmax(dim=-1))
    return accepted, torch.where(accepted, draft, tokens)


def _coins(params: list[SamplingParams], draws: list[int], dev: torch.device) -> torch.Tensor:
    """Uniform [0, 1) coins [R]: a seeded row's from (seed, draw) alone."""
    coins = torch.rand(len(params), device=dev)
    for i, (p, draw) in enumerate(zip(params, draws, strict=True)):
        if p.seed is not None:
            coins[i] = torch.rand(1, device=dev, generator=_generator(p.seed ^ _COIN, draw, dev))[0]
    return coins


def accepted_tokens(drafts: list[int], accepted: list[bool], tokens: list[int]) -> list[int]:
    """One request's emitted tokens from its rows' host results: its drafts up to the first
    rejected one, then that row's token (or the bonus row's)."""
    a = 0
    while a < len(drafts) and accepted[a]:
        a += 1
    return drafts[:a] + [tokens[a]]
