"""Layers split across a tensor-parallel group (engine.parallel.TensorParallel), as the
DeepSeek-V4 release's inference/model.py splits them, plus the marks that tell the checkpoint
loader which slice of a tensor a rank holds.

- column parallel: the output dim is split, nothing to reduce (`column_parallel`);
- row parallel: the input dim is split and the partial products are summed over the group in
  fp32 (`RowParallelLinear`; FP8 ones in engine.layers.fp8_linear, which round the sum once, as
  the unsplit GEMM does; dense bf16 layers round each partial first, as the release does);
- vocabulary parallel: the embedding's and the head's rows are split; the embedding sums its
  one-hot rows over the group, the head gathers its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.engine.parallel.group import TensorParallel, shard


def column_parallel(layer: torch.nn.Module) -> torch.nn.Module:
    """Mark a linear layer (dense or FP8: its weight and block scale) as split along its output."""
    for name in ("weight", "scale"):
        if hasattr(layer, name):
            shard(getattr(layer, name), 0)
    return layer


class RowParallelLinear(torch.nn.Linear):
    """A dense linear layer holding its rank's columns of the weight [out, in / size]."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp
        shard(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.tp.size == 1:
            return y
        return self.tp.all_reduce(y.float()).to(x.dtype)


class VocabParallelEmbedding(torch.nn.Embedding):
    """Rows [start, stop) of the vocabulary; other tokens look up zeros here, found elsewhere."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__(tp.local(vocab_size), dim)
        self.tp, (self.start, self.stop) = tp, tp.span(vocab_size)
        shard(self.weight, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        rows = torch.where(mine[:, None], F.embedding(local, self.weight), 0)  # [N, dim]
        return self.tp.all_reduce(rows)  # exactly one rank adds a non-zero row


class VocabParallelHead(torch.nn.Linear):
    """The LM head's rows [start, stop) of the vocabulary; every rank gets all fp32 logits."""

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(dim, tp.local(vocab_size), bias=False)
        self.tp = tp
        shard(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> fp32 logits [N, vocab]."""
        return self.tp.all_gather(super().forward(x).float())
