"""The lightning indexer's top-k over a step's rows, whichever family's indexer asks: one
`kernels.indexer_topk` call per run of rows that shares page-table rows (the decode rows, then
each prefill chunk: engine.step.StepState.row_tables)."""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepState


def step_topk(
    step: StepState,
    tables: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """q [N, Hi, Di], weights [N, Hi] fp32, lengths [N] int32 of the step's rows; tables
    [B, pages] the page tables that address k_cache's keys, a row per request -> [N, topk]
    int32 key positions (-1 = none); kernels.indexer_topk's semantics row by row."""
    with profiled("indexer_topk"):
        picked = [
            kernels.indexer_topk(
                q[rows], weights[rows], k_cache, table, lengths[rows], topk, scale=scale
            )
            for rows, table in step.row_tables(tables)
        ]
    return torch.cat(picked) if len(picked) > 1 else picked[0]
