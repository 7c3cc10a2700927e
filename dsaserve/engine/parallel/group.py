"""A tensor-parallel group as the model sees it: this rank, the group size, and the collectives
the split layers use. On a group of one every collective is the identity, so a model built for
one rank runs exactly the code it ran before tensor parallelism existed.

Which weights are split, along which dim, is recorded on the parameters themselves
(`shard(param, dim)`, `shard_experts(param, start, stop)`): the checkpoint loader reads only this
rank's slice of each, and `engine.models.deepseek_v4` decides the split (its module docstrings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from dsaserve.engine.parallel.expert_parallel import ExpertParallel, Experts

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # NCCL on GPUs, gloo on the CPU; None for one rank
    # --enable-expert-parallel: the routed experts split over every rank of the data-parallel
    # group (dispatch/combine all-to-alls) instead of over this group (an all-reduce)
    ep: ExpertParallel | None = None
    leader: int = 0  # the global rank of this group's rank 0 (data parallel: not always 0)

    def local(self, n: int) -> int:
        """This rank's share of n items (the model config checked that size divides n)."""
        assert n % self.size == 0, f"{n} items do not split over {self.size} ranks"
        return n // self.size

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous range [start, stop) of n items."""
        per = self.local(n)
        return self.rank * per, (self.rank + 1) * per

    def expert_span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous range [start, stop) of a model's n routed experts."""
        return self.ep.span(n) if self.ep is not None else self.span(n)

    def routed_experts(
        self,
        experts: Experts,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        span: tuple[int, int],
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] (the model's ids) -> fp32 [T, hidden]: the
        weighted sum of each token's routed experts, on every rank of the group; span: this
        rank's experts (`expert_span`)."""
        if self.ep is None:  # ids outside this rank's range add nothing there
            return self.all_reduce(experts(x, expert_ids - span[0], weights))
        per, share = span[1] - span[0], (self.rank, self.size)
        routed = self.ep.dispatch_combine(experts, x, expert_ids, weights, per, share)
        return self.all_reduce(routed)  # the tensor-parallel members' row shares

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank r's columns at [r * n, (r + 1) * n)."""
        if self.size == 1:
            return x
        rows, n = x.shape
        out = torch.empty(self.size * rows, n, dtype=x.dtype, device=x.device)  # [size*rows, n]
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, rows, n).transpose(0, 1).reshape(rows, self.size * n)

    def agree(self, value: int, device: torch.device) -> int:
        """The smallest `value` of any rank, on every rank (sizes all ranks must share)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place; returns x."""
        if self.size > 1:
            dist.broadcast(x, src=self.leader, group=self.group)
        return x


SINGLE = TensorParallel()
P = TypeVar("P", bound=torch.Tensor)  # a parameter (nn.Linear's weight is typed a Tensor)


def shard(param: P, dim: int) -> P:
    """Mark `param` as this rank's contiguous slice of the checkpoint tensor along `dim`."""
    param.tp_dim = dim  # type: ignore[attr-defined]  # a mark of ours, read by the loader
    return param


def shard_experts(param: P, start: int, stop: int) -> P:
    """Mark a stacked-experts `param` as holding experts [start, stop) of the checkpoint."""
    param.tp_experts = (start, stop)  # type: ignore[attr-defined]  # (as tp_dim)
    return param
