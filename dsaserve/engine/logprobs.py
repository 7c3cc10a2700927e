"""Log-probabilities of sampled tokens, for the OpenAI `logprobs` fields.

Which distribution: the model's raw one, `log_softmax(logits)` in fp32 over the tokenizer's
vocabulary, before temperature, top-k and top-p (vLLM's default, "raw logprobs"). So a token's
logprob does not depend on how it was sampled: greedy and sampled requests report the same
numbers for the same text, and they equal what `LLM.score` gives for that text. (The processed
distribution would give 0 for every greedy token and -inf outside top-k, which says nothing.)

One batch, on the device: one log_softmax over the rows that asked, one gather of the sampled
tokens, one topk as wide as the widest request, into one table (`logprob_table`) that reaches
the host with the sampled ids, without a wait of its own (engine.async_copy); `read_logprobs`
turns the host copy into one entry per row.

Prompt logprobs (`SamplingParams.prompt_logprobs`; the completions' `echo`) take the same
measure over the prompt's tokens: the runner adds a prefill chunk's prompt rows to the step's
logit rows and engine.outputs' `score_prompts` scores them; a prefill worker returns them with
its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.engine.async_copy import to_device


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprob and the likeliest alternatives (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def logprob_table(
    logits: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]
) -> torch.Tensor | None:
    """logits [B, V] fp32 (padded vocabulary rows already -inf); tokens [B] the ids sampled from
    them (on the device); counts[b] how many alternatives row b wants (None: no logprobs) ->
    float64 [R, 1 + 2 * width] on the device, one row per b that asked (chosen logprob, the
    `width` best logprobs, their ids; ids are exact in float64, vocabularies being far below
    2**53), or None when no row asked."""
    rows = [b for b, k in enumerate(counts) if k is not None]
    if not rows:
        return None
    sel = to_device(rows, torch.int64, logits.device)
    logprobs = logits[sel].float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, tokens[sel, None])  # [R, 1]
    width = max(counts[b] or 0 for b in rows)
    top_values, top_ids = logprobs.topk(width, dim=-1)  # [R, width]; width 0 is fine
    return torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1)


def read_logprobs(
    table: torch.Tensor | None, counts: list[int | None]
) -> list[TokenLogprobs | None]:
    """The host copy of `logprob_table(..., counts)` -> one entry per row (None: not asked)."""
    out: list[TokenLogprobs | None] = [None] * len(counts)
    if table is None:
        return out
    rows = [b for b, k in enumerate(counts) if k is not None]
    width = (table.shape[1] - 1) // 2
    for row, b in zip(table.tolist(), rows, strict=True):
        k = counts[b] or 0
        out[b] = TokenLogprobs(
            logprob=row[0],
            top_ids=tuple(int(i) for i in row[1 + width : 1 + width + k]),
            top_logprobs=tuple(row[1 : 1 + k]),
        )
    return out
