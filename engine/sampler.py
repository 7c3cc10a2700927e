"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws its noise for output token i from a generator seeded with
(seed, i) alone, so its tokens do not depend on the batch it shares or on which worker
runs which token (prefill samples token 0, decode the rest).

Everything stays on the device: the sampled ids are a device tensor, which the next step reads
as its input before the host has seen them (async scheduling), and nothing here waits for the
device.
"""

from __future__ import annotations

import torch

from engine.async_copy import to_device
from engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15


def _generator(seed: int, draw: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed ^ (draw * _GOLDEN)) & (2**63 - 1))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int]) -> torch.Tensor:
    """logits [B, V] fp32; draws[b] = index of the output token being sampled -> [B] int64 ids
    on the logits' device."""
    tokens = logits.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    dev, vocab = logits.device, logits.shape[1]
    sel = to_device(rows, torch.int64, dev)
    temp, top_p = to_device(
        [[params[b].temperature for b in rows], [params[b].top_p for b in rows]],
        torch.float32,
        dev,
    )
    top_k = to_device([params[b].top_k or vocab for b in rows], torch.int64, dev)
    sorted_logits, order = (logits[sel] / temp[:, None]).sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=dev)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
    noise = torch.empty_like(probs).exponential_()  # unseeded rows: the global generator
    for i, b in enumerate(rows):
        seed = params[b].seed
        if seed is not None:
            noise[i].exponential_(generator=_generator(seed, draws[b], dev))
    picked = (probs / noise).argmax(dim=-1)  # exponential race
    tokens[sel] = order.gather(1, picked[:, None]).squeeze(1)
    return tokens
