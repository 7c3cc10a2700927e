"""Which of a step's rows each DeepSeek-V4.1 layer computes: bounded decoder replay in prefill.

The layers past the last KV source keep nothing but their window rows, and only the positions
whose state must be exact read them: where the request samples and where the prefix cache may
checkpoint it (RowSpan.anchors). So a prefill chunk runs such a layer only on the rows within
its halo (ModelConfig.halo) before each anchor, and the last KV source's attention and MoE only
on the first such layer's rows; every other layer (and the last KV source's KV: its entries and
index keys, which every later row reads) runs on every row. The state at each anchor is then
exactly what a prefill of every row leaves (the halo is the whole dependency cone), at a cost
that no longer grows with the prompt: the decoder half computes ~26.5 K row-layers per anchor
on V4.1-Flash instead of 20 per token (vLLM's and SGLang's "decoder SWA bounded replay"
computes 128 rows per layer and is an approximation: its rows' windows are cut short).

A checkpoint of the prefix cache is such an anchor: with one every 512 tokens and V4.1-Flash's
halo of 2,414 rows, a long prompt's decoder rows are nearly all computed;
--prefix-cache-checkpoint-interval well above the halo keeps the saving. (The 128-row replay is
not the model: on the tiny model it changed a 40-token prompt's greedy tokens.)

Decode rows (and a span without anchors: prompt logprobs, scoring) are computed everywhere.
A step where every row is computed everywhere (every decode step) has no plan (`None` rows):
nothing here costs a decode step anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.step import StepInputs


@dataclass(frozen=True)
class Rows:
    """A subset of a step's rows, in step order (the decode rows first)."""

    index: torch.Tensor  # [M] int64 step rows, on the device
    # prefill rows of the subset that persist to the window ring after attention: their
    # positions in the subset and in the step
    persist_local: torch.Tensor  # [P] int64
    persist_global: torch.Tensor  # [P] int64


class RowPlan:
    """Per layer, the rows it takes as input and the rows whose output it computes (None: all)."""

    def __init__(self, cfg: ModelConfig, inputs: StepInputs, ring_len: int) -> None:
        self.inputs: list[Rows | None] = [None] * cfg.num_layers
        self.outputs: list[Rows | None] = [None] * cfg.num_layers
        dist = _anchor_distance(inputs)
        if dist is None:
            return
        persist = np.zeros(inputs.num_rows, dtype=bool)
        for seg in inputs.segments:  # (the newest ring_len rows of a chunk: StepInputs)
            persist[seg.row0 + max(0, seg.num_rows - ring_len) : seg.row0 + seg.num_rows] = True
        persist[: inputs.num_decode] = False  # (decode rows persist before attention)
        made: dict[int, Rows | None] = {}
        device = inputs.positions.device

        def rows(halo: int | None) -> Rows | None:
            if halo is None:
                return None
            if halo not in made:
                keep = dist <= halo
                made[halo] = None if keep.all() else _rows(np.flatnonzero(keep), persist, device)
            return made[halo]

        for layer in range(cfg.num_layers):
            self.inputs[layer] = rows(cfg.halo(layer))
            self.outputs[layer] = rows(cfg.out_halo(layer))

    @property
    def trims(self) -> bool:
        """Whether some layer skips some rows."""
        return any(r is not None for r in self.inputs + self.outputs)


def _anchor_distance(inputs: StepInputs) -> np.ndarray | None:
    """[N] for each row, how far its position lies before the next anchor of its request
    (1: the anchor's own last row; 0 for a row every layer computes); None where every row is."""
    if all(seg.anchors is None for seg in inputs.segments):
        return None
    dist = np.zeros(inputs.num_rows, dtype=np.int64)  # decode rows: 0
    for seg in inputs.segments:
        if seg.anchors is None:
            continue
        positions = np.arange(seg.start, seg.start + seg.num_rows)
        anchors = np.array([*seg.anchors, np.iinfo(np.int64).max // 2], dtype=np.int64)
        ahead = anchors[np.searchsorted(anchors, positions, side="right")]
        dist[seg.row0 : seg.row0 + seg.num_rows] = ahead - positions
    return dist


def _rows(index: np.ndarray, persist: np.ndarray, device: torch.device) -> Rows:
    local = np.flatnonzero(persist[index])
    return Rows(
        to_device(index, torch.int64, device),
        to_device(local, torch.int64, device),
        to_device(index[local], torch.int64, device),
    )
