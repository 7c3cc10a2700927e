"""Expert parallelism across a data-parallel group: the routed experts split over every rank of
every attention rank's group, each token's (token, expert) pairs sent to the experts' owner and
the results sent back (dispatch and combine, two all-to-alls each way, as DeepEP's normal mode;
gloo on the CPU, NCCL on GPUs).

Each attention (data-parallel) rank has its own tokens. Inside one rank, a tensor-parallel group
holds the same tokens on every member, so each member dispatches a contiguous share of the rows
and the shares are summed over the tensor-parallel group afterwards (one all-reduce, where plain
tensor parallelism all-reduces the routed sums anyway).

The all-to-alls' sizes differ per step and rank, so each dispatch first exchanges the counts
(a host sync): these steps run eagerly. A pair travels on its own, so a token whose k experts
share an owner crosses k times (DeepEP sends it once; a later optimisation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# experts(x [n, hidden], local expert ids [n, k], weights [n, k]) -> fp32 [n, hidden]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertParallel:
    rank: int  # this rank's place among all ranks of the data-parallel group
    size: int  # data-parallel size x tensor-parallel size
    group: dist.ProcessGroup | None = None  # every rank (the world)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous range [start, stop) of n experts."""
        assert n % self.size == 0, f"{n} experts do not split over {self.size} ranks"
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def dispatch_combine(
        self,
        experts: Experts,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        per: int,
        share: tuple[int, int] = (0, 1),
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] (global ids) -> fp32 [T, hidden]: the
        weighted sum of each token's routed experts for the rows of `share` = (this member, the
        tensor-parallel size) of a tensor-parallel group, zeros elsewhere; per: experts per rank."""
        num_rows, k = expert_ids.shape
        member, members = share
        lo = num_rows * member // members
        hi = num_rows * (member + 1) // members
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
        flat = expert_ids[lo:hi].reshape(-1)  # [n*k]
        owner = torch.div(flat, per, rounding_mode="floor")  # [n*k]
        order = torch.argsort(owner, stable=True)  # pairs grouped by the rank that owns them
        token = torch.div(order, k, rounding_mode="floor") + lo  # [n*k] the pair's row in x
        send = torch.bincount(owner, minlength=self.size)  # [size] pairs to each rank
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_n, recv_n = send.tolist(), recv.tolist()  # (the host sync)
        # local id and weight of each pair, as fp32 columns (ids < 2^24 are exact)
        meta = torch.stack(
            [(flat - owner * per)[order].float(), weights[lo:hi].reshape(-1)[order].float()], 1
        )  # [n*k, 2]
        got_x = x.new_empty(sum(recv_n), x.shape[1])  # [R, hidden]
        got_meta = meta.new_empty(sum(recv_n), 2)  # [R, 2]
        dist.all_to_all_single(got_x, x[token].contiguous(), recv_n, send_n, group=self.group)
        dist.all_to_all_single(got_meta, meta, recv_n, send_n, group=self.group)
        if got_x.shape[0]:
            ids = got_meta[:, :1].long()  # [R, 1]
            done = experts(got_x, ids, got_meta[:, 1:]).float()  # [R, hidden]
        else:  # (the grouped GEMMs want rows)
            done = torch.zeros(0, x.shape[1], dtype=torch.float32, device=x.device)
        back = done.new_empty(len(order), x.shape[1])  # [n*k, hidden], in `order`
        dist.all_to_all_single(back, done, send_n, recv_n, group=self.group)
        return out.index_add_(0, token, back)
