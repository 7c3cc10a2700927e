"""What a request's sampling parameters do to its logits before a token is drawn, as vLLM's
sampler applies them, in its order: `allowed_token_ids` (every other token masked),
`bad_words`, `min_tokens` (EOS and stop tokens masked until then), `logit_bias`, then the
repetition, frequency and presence penalties. `min_p` acts later, inside the sampler, on the
temperature-scaled distribution (it moves no argmax: engine.sampler). Logprobs stay the raw
distribution's (engine.logprobs): these change what is drawn, not what is reported.

The formulas (vLLM's `apply_penalties`; OpenAI's presence and frequency penalties):
    repetition r   a token of the prompt or of the output: logit / r if logit > 0, else logit * r
    frequency f    logit - f * (times the token occurs in the output)
    presence p     logit - p * (1 if the token occurs in the output)
    logit_bias     logit + bias[token] (biases clamped to [-100, 100]: SamplingParams)
    bad_words      a word of one token is banned; a longer one's last token is banned where the
                   output ends with the rest of it (each word tokenized alone and after a space)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class RowTokens:
    """What one logit row's processors read: its request's parameters and tokens before it."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # every output token before this row's (ids: only if `reads_ids`)
    num_output: int  # len(output), also where the ids are not known (min_tokens reads only it)
    stop_ids: frozenset[int]  # what min_tokens masks: EOS (unless ignored) and stop tokens
    bad_words: Sequence[Sequence[int]] = ()  # token ids of each bad word (`bad_words_ids`)


def reads_ids(params: SamplingParams) -> bool:
    """Whether a row's processing reads its request's token ids (not just their number)."""
    return params.penalized or bool(params.bad_words)


def changes_logits(params: SamplingParams) -> bool:
    """Whether these parameters change any logit before sampling."""
    return (
        reads_ids(params)
        or params.min_tokens > 0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
    )


def bad_words_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (a word at the start of the text and
    in its middle tokenize apart), as vLLM's `SamplingParams.update_from_tokenizer` does: the
    spaced form only where it makes a new first token of the same length."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return [ids for ids in out if ids]


def adjust(logits: torch.Tensor, rows: Sequence[RowTokens | None]) -> torch.Tensor:
    """logits [R, V] fp32 -> the logits to sample from (a new tensor where any row changes;
    `logits` itself is left as it is). rows[r]: row r's tokens, None for a row left alone."""
    if not any(r is not None and changes_logits(r.params) for r in rows):
        return logits
    out, dev, vocab = logits.clone(), logits.device, logits.shape[1]
    banned: list[tuple[int, int]] = []  # (row, token) masked to -inf
    biased: list[tuple[int, int, float]] = []
    penalized: list[int] = []
    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        if p.allowed_token_ids is not None:
            keep = torch.full((vocab,), float("-inf"), device=dev)
            keep[to_device(p.allowed_token_ids, torch.int64, dev)] = 0.0
            out[i] += keep
        for word in row.bad_words:
            head = list(word[:-1])
            if not head or list(row.output[len(row.output) - len(head) :]) == head:
                banned.append((i, word[-1]))
        if row.num_output < p.min_tokens:
            banned += [(i, t) for t in row.stop_ids]
        biased += [(i, t, b) for t, b in p.logit_bias.items()]
        if p.penalized:
            penalized.append(i)
    if biased:
        at = to_device([[r for r, _, _ in biased], [t for _, t, _ in biased]], torch.int64, dev)
        values = to_device([b for _, _, b in biased], torch.float32, dev)
        out.index_put_((at[0], at[1]), values, accumulate=True)
    if penalized:
        _penalize(out, [rows[i] for i in penalized], penalized)  # type: ignore[misc]
    if banned:
        at = to_device([[r for r, _ in banned], [t for _, t in banned]], torch.int64, dev)
        out[at[0], at[1]] = float("-inf")
    return out


def _penalize(logits: torch.Tensor, rows: list[RowTokens], index: list[int]) -> None:
    """The repetition, frequency and presence penalties of rows `index` of logits [R, V]
    (in place), from their tokens' counts built on the device."""
    dev, vocab = logits.device, logits.shape[1]
    n = len(rows)
    counts = torch.zeros(n, vocab, device=dev)  # [n, V] occurrences in the output
    _count(counts, [r.output for r in rows])
    seen_prompt = torch.zeros(n, vocab, device=dev)  # [n, V] occurrences in the prompt
    if any(r.params.repetition_penalty != 1 for r in rows):
        _count(seen_prompt, [r.prompt for r in rows])
    sel = to_device(index, torch.int64, dev)
    rep, freq, pres = to_device(
        [
            [r.params.repetition_penalty for r in rows],
            [r.params.frequency_penalty for r in rows],
            [r.params.presence_penalty for r in rows],
        ],
        torch.float32,
        dev,
    )
    x = logits[sel]  # [n, V]
    seen = (counts > 0) | (seen_prompt > 0)
    r = rep[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    logits[sel] = x


def _count(counts: torch.Tensor, token_lists: list[Sequence[int]]) -> None:
    """counts [n, V] += each list's token occurrences (one scatter over their padded ids)."""
    width = max((len(t) for t in token_lists), default=0)
    if width == 0:
        return
    vocab = counts.shape[1]
    ids = to_device(
        [list(t) + [vocab] * (width - len(t)) for t in token_lists], torch.int64, counts.device
    )  # [n, width], padded with an id past the vocabulary
    padded = torch.zeros(counts.shape[0], vocab + 1, device=counts.device)
    padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=padded.dtype))
    counts += padded[:, :vocab]
