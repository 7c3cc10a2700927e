"""DSpark's pieces that do not depend on the family's layers: the Markov head, the confidence
head and the serial pass that turns a block's base logits into drafts.

A DSpark draft block at anchor position p has gamma rows: the anchor token, then gamma - 1 noise
tokens; row k's hidden state h_k (after the draft layers and the head's mHC collapse) gives base
logits U_k = head(norm(h_k)) of the token at p + k + 1. The Markov head then adds, serially, a
bias from the token before:

    e_k = W1[x_{k-1}]               x_{-1} = the anchor, x_k = the draft of row k   [r]
    d_k = argmax(U_k + W2 e_k)      W1 [V, r] (markov_w1), W2 [V, r] (markov_w2)
    c_k = sigmoid(w . [h_k ; e_k])  the confidence head (optional): the chance d_k is accepted
                                    given d_0..d_{k-1} were (DeepSpec trains it on the
                                    acceptance rate 1 - TV(draft, target))

Drafts are greedy (q one-hot), which engine.speculative.verify's rejection sampling assumes.
Both heads are replicated under tensor parallelism (the serial pass would otherwise pay a
collective per position); the logits arrive whole (the vocabulary-parallel head gathers them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MarkovHead(torch.nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = torch.nn.Embedding(vocab_size, rank)
        self.markov_w2 = torch.nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [B] token ids -> (e [B, r], the bias W2 e [B, V] fp32)."""
        e = self.markov_w1(prev)
        return e, self.markov_w2(e).float()


class ConfidenceHead(torch.nn.Module):
    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden + rank, 1, bias=False, dtype=torch.float32)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [B, H], e [B, r] -> the chance of acceptance [B] fp32."""
        return torch.sigmoid(F.linear(torch.cat([h, e], -1).float(), self.proj.weight)).squeeze(-1)


def draft_block(
    base: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    markov: MarkovHead,
    confidence: ConfidenceHead | None,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """base [B, gamma, V] fp32 logits, hidden [B, gamma, H] of the block rows, anchors [B] ->
    (drafts [B, gamma] int64 among the first `vocab` ids, confidences [B, gamma] fp32 or None
    without a confidence head), on the device."""
    gamma = base.shape[1]
    drafts, confs = [], []
    prev = anchors
    for k in range(gamma):
        e, bias = markov(prev)
        prev = (base[:, k, :vocab] + bias[:, :vocab]).argmax(dim=-1)
        drafts.append(prev)
        if confidence is not None:
            confs.append(confidence(hidden[:, k], e))
    return torch.stack(drafts, 1), torch.stack(confs, 1) if confs else None
