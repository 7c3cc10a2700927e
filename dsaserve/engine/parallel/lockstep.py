"""Data-parallel engines step together: the MoE layers' all-to-alls need every rank of the world
in the same forward, so before each step the engines' leaders agree whether any of them has
work (one all-reduce over a gloo group of the leaders), and one without work runs a padded empty
step (as vLLM's idle data-parallel ranks run a dummy batch). The same message carries a stop:
an engine that closes tells the others, which leave their loops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class Agreement(NamedTuple):
    work: bool  # some engine runs a forward this step
    stop: bool  # some engine is closing the group


class Lockstep:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._flags = torch.zeros(2, dtype=torch.int64)

    def agree(self, work: bool, stop: bool = False) -> Agreement:
        """Every leader calls this once per step, with whether it has a forward to run."""
        self._flags[0], self._flags[1] = int(work), int(stop)
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        return Agreement(bool(self._flags[0]), bool(self._flags[1]))
