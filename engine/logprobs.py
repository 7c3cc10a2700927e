"""Log-probabilities of sampled tokens, for the OpenAI `logprobs` fields.

Which distribution: the model's raw one, `log_softmax(logits)` in fp32 over the tokenizer's
vocabulary, before temperature, top-k and top-p (vLLM's default, "raw logprobs"). So a token's
logprob does not depend on how it was sampled: greedy and sampled requests report the same
numbers for the same text, and they equal what `LLM.score` gives for that text. (The processed
distribution would give 0 for every greedy token and -inf outside top-k, which says nothing.)

One batch, on the device: one log_softmax over the rows that asked, one gather of the sampled
tokens, one topk as wide as the widest request, and one copy to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprob and the likeliest alternatives (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], counts: list[int | None]
) -> list[TokenLogprobs | None]:
    """logits [B, V] fp32 (padded vocabulary rows already -inf); tokens[b] the id sampled from
    row b; counts[b] how many alternatives row b wants (None: no logprobs) -> one per row."""
    rows = [b for b, k in enumerate(counts) if k is not None]
    if not rows:
        return [None] * len(counts)
    device = logits.device
    sel = torch.tensor(rows, device=device)
    logprobs = logits[sel].float().log_softmax(dim=-1)  # [R, V]
    sampled = torch.tensor([tokens[b] for b in rows], device=device)
    chosen = logprobs.gather(1, sampled[:, None])  # [R, 1]
    width = max(counts[b] or 0 for b in rows)
    top_values, top_ids = logprobs.topk(width, dim=-1)  # [R, width]; width 0 is fine
    # One host copy: ids are exact in float64 (vocabularies are far below 2**53).
    host = torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1).tolist()
    out: list[TokenLogprobs | None] = [None] * len(counts)
    for row, b in zip(host, rows, strict=True):
        k = counts[b] or 0
        out[b] = TokenLogprobs(
            logprob=row[0],
            top_ids=tuple(int(i) for i in row[1 + width : 1 + width + k]),
            top_logprobs=tuple(row[1 : 1 + k]),
        )
    return out
