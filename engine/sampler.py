"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws its noise for output token i from a generator seeded with
(seed, i) alone, so its tokens do not depend on the batch it shares or on which worker
runs which token (prefill samples token 0, decode the rest).
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15


def _generator(seed: int, draw: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed ^ (draw * _GOLDEN)) & (2**63 - 1))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int]) -> list[int]:
    """logits [B, V] fp32; draws[b] = index of the output token being sampled -> B token ids."""
    tokens = logits.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        sel = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([params[b].temperature for b in rows], device=logits.device)
        sorted_logits, order = (logits[sel] / temp[:, None]).sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(logits.shape[1], device=logits.device)
        top_k = torch.tensor(
            [params[b].top_k or logits.shape[1] for b in rows], device=logits.device
        )
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([params[b].top_p for b in rows], device=logits.device)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
        noise = torch.empty_like(probs)
        for i, b in enumerate(rows):
            seed = params[b].seed
            gen = _generator(seed, draws[b], logits.device) if seed is not None else None
            noise[i].exponential_(generator=gen)
        picked = (probs / noise).argmax(dim=-1)  # exponential race
        tokens[sel] = order.gather(1, picked[:, None]).squeeze(1)
    return tokens.tolist()
