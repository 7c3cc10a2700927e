"""Paged addressing: logical positions of a request -> slot ids of a paged pool."""

from __future__ import annotations

import torch


def positions_to_slots(
    positions: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Map positions [B, K] (int, -1 = none) through page_table [B, max_pages] to slot ids.

    Slot of position j of row b = page_table[b, j // page_size] * page_size + j % page_size,
    the row index into the pool viewed as [num_pages * page_size, ...]; -1 stays -1. Pure tensor
    ops (no host sync), so it runs inside CUDA graphs. Returns int32 [B, K].
    """
    pos = positions.long().clamp(min=0)  # [B, K]
    # (gathered as stored: a broadcast table [B, pages] with stride 0 is never materialised)
    page = torch.gather(page_table, 1, pos // page_size).long()  # [B, K]
    slots = page * page_size + pos % page_size
    return torch.where(positions >= 0, slots, -1).to(torch.int32)
