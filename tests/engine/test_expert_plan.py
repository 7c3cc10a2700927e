"""Expert parallelism's send plan (engine/parallel/expert_parallel.OwnerPlan), in one process:
each (token, owner rank) is one slot, and the owners' per-slot partial sums, added back at the
slots' rows, are every token's weighted sum of its experts. The processes and all-to-alls
around it: tests/engine/test_data_parallel.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.parallel.expert_parallel import OwnerPlan


def _routing(n: int, k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g)[:k] for _ in range(n)]
    ids = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)  # [n, k]
    return ids, torch.rand(n, k, generator=g)


@pytest.mark.parametrize(
    ("n", "k", "experts", "size"), [(7, 4, 16, 2), (33, 8, 64, 4), (0, 2, 8, 2)]
)
def test_each_token_crosses_once_per_owner_and_the_slot_sums_add_up(n, k, experts, size):
    ids, weights = _routing(n, k, experts, n)
    per = experts // size
    plan = OwnerPlan.of(ids, weights, per, size)
    owners = [set((ids[t] // per).tolist()) for t in range(n)]
    assert plan.slots_to.tolist() == [sum(r in o for o in owners) for r in range(size)]
    assert (
        plan.pairs_to.tolist() == torch.bincount((ids // per).reshape(-1), minlength=size).tolist()
    )
    assert plan.slot_row.numel() == sum(len(o) for o in owners) <= n * k

    x = torch.randn(n, 5)  # [n, hidden]
    scale = torch.arange(1, experts + 1, dtype=torch.float32)  # expert e: x * (e + 1)
    want = (weights.unsqueeze(-1) * x.unsqueeze(1) * scale[ids].unsqueeze(-1)).sum(1)  # [n, 5]
    # what the owners compute, rank by rank, from the plan's blocks
    got = torch.zeros(n, 5)
    slot_start = pair_start = 0
    for rank in range(size):
        slots, pairs = int(plan.slots_to[rank]), int(plan.pairs_to[rank])
        rows = plan.slot_row[slot_start : slot_start + slots]  # [slots] what it receives
        meta = plan.meta[pair_start : pair_start + pairs]  # [pairs, 3]
        local, weight, slot = meta[:, 0].long(), meta[:, 1], meta[:, 2].long()
        assert bool(((local >= 0) & (local < per)).all()) and bool((slot < slots).all())
        partial = torch.zeros(slots, 5).index_add_(
            0, slot, weight[:, None] * x[rows][slot] * scale[local + rank * per][:, None]
        )
        got.index_add_(0, rows, partial)
        slot_start, pair_start = slot_start + slots, pair_start + pairs
    torch.testing.assert_close(got, want)
