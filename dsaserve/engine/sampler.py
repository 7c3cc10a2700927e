"""Batched token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds (on
logits the request's other parameters have already acted on: engine.logits_processors).

A seeded request draws its noise for output token i from a generator seeded with
(seed, i) alone, so its tokens do not depend on the batch it shares or on which worker
runs which token (prefill samples token 0, decode the rest).

Everything stays on the device: the sampled ids are a device tensor, which the next step reads
as its input before the host has seen them (async scheduling), and nothing here waits for the
device.
"""

from __future__ import annotations

import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.structured import Bitmask, apply_bitmask

_GOLDEN = 0x9E3779B97F4A7C15


def _generator(seed: int, draw: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed ^ (draw * _GOLDEN)) & (2**63 - 1))
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    draws: list[int],
    mask: Bitmask | None = None,
) -> torch.Tensor:
    """logits [B, V] fp32; draws[b] = index of the output token being sampled -> [B] int64 ids
    on the logits' device. `mask`: the tokens a structured output's rows may take (the others
    are never sampled; `logits` itself is left as it is).

    Rows without top-k or top-p race over the whole vocabulary as it is; only rows that
    truncate it sort their logits (a [B, 129280] sort is a millisecond at B = 64). Which way a
    row goes depends on its own parameters only, so a seeded row's tokens never depend on
    its batch."""
    if mask is not None:
        logits = apply_bitmask(logits, mask)
    tokens = logits.argmax(dim=-1)
    vocab = logits.shape[1]
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    truncated = [b for b in sampled if _truncates(params[b], vocab)]
    cut = set(truncated)  # (a set: a list's `in` would make this quadratic in the batch)
    plain = [b for b in sampled if b not in cut]
    for rows, race in ((plain, _race), (truncated, _truncated_race)):
        if rows:
            sel = to_device(rows, torch.int64, logits.device)
            tokens[sel] = race(logits, sel, [params[b] for b in rows], [draws[b] for b in rows])
    return tokens


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution `sample` draws each row from: [B, V] fp32 (a greedy row one-hot at its
    argmax; the others softmax(logits / temperature), after top-k and top-p where set)."""
    vocab, dev = logits.shape[1], logits.device
    probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).float()
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    truncated = [b for b in sampled if _truncates(params[b], vocab)]
    plain = [b for b in sampled if not _truncates(params[b], vocab)]
    if plain:
        sel = to_device(plain, torch.int64, dev)
        temp = to_device([params[b].temperature for b in plain], torch.float32, dev)
        probs[sel] = (logits[sel] / temp[:, None]).softmax(dim=-1)
    if truncated:
        sel = to_device(truncated, torch.int64, dev)
        sorted_probs, order = _sorted_probs(logits, sel, [params[b] for b in truncated])
        kept = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs[sel] = torch.zeros_like(kept).scatter(1, order, kept)
    return probs


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return p.top_p < 1 or 0 < p.top_k < vocab or p.min_p > 0


def _noise(
    shape: tuple[int, int], params: list[SamplingParams], draws: list[int], dev: torch.device
) -> torch.Tensor:
    """Exponential(1) noise [R, V]: a seeded row's from (seed, draw) alone, the others' from
    the global generator."""
    noise = torch.empty(shape, device=dev)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if len(unseeded) == len(params):
        return noise.exponential_()
    if unseeded:
        rows = to_device(unseeded, torch.int64, dev)
        noise[rows] = torch.empty(len(unseeded), shape[1], device=dev).exponential_()
    for i, (p, draw) in enumerate(zip(params, draws, strict=True)):
        if p.seed is not None:
            noise[i].exponential_(generator=_generator(p.seed, draw, dev))
    return noise


def _race(
    logits: torch.Tensor, sel: torch.Tensor, params: list[SamplingParams], draws: list[int]
) -> torch.Tensor:
    """Rows `sel` sampled from softmax(logits / temperature): the exponential race in its
    Gumbel form, argmax(logits / t - log(noise)) (softmax's normalizer moves no argmax)."""
    dev = logits.device
    temp = to_device([p.temperature for p in params], torch.float32, dev)
    scaled = logits[sel] / temp[:, None]  # [R, V]
    noise = _noise((scaled.shape[0], scaled.shape[1]), params, draws, dev)
    return (scaled - noise.log()).argmax(dim=-1)


def _truncated_race(
    logits: torch.Tensor, sel: torch.Tensor, params: list[SamplingParams], draws: list[int]
) -> torch.Tensor:
    """Rows `sel` sampled after top-k and top-p, over their logits sorted by probability."""
    probs, order = _sorted_probs(logits, sel, params)
    picked = (
        probs / _noise((probs.shape[0], probs.shape[1]), params, draws, logits.device)
    ).argmax(dim=-1)  # race
    return order.gather(1, picked[:, None]).squeeze(1)


def _sorted_probs(
    logits: torch.Tensor, sel: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `sel` after temperature, min-p, top-k and top-p (vLLM's order): (their
    probabilities [R, V] sorted in descending order, the dropped ones 0 and the rest not
    renormalized; the token of each column [R, V])."""
    dev, vocab = logits.device, logits.shape[1]
    temp, top_p, min_p = to_device(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        torch.float32,
        dev,
    )
    top_k = to_device([p.top_k or vocab for p in params], torch.int64, dev)
    sorted_logits, order = (logits[sel] / temp[:, None]).sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=dev)
    # min-p: a token less likely than min_p x the likeliest one (column 0) is dropped
    full = sorted_logits.softmax(dim=-1)  # [R, V]
    below = full < min_p[:, None] * full[:, :1]
    sorted_logits = sorted_logits.masked_fill(below | (rank >= top_k[:, None]), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    return probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0), order
