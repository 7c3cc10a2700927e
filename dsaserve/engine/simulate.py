"""A simulated model for the control plane (`--simulate PROFILE`, as Dynamo's "mocker"): the
engine around it is the real one (scheduler, KV pools and page accounting, prefix cache and its
events, leases, staging, transfers of the pages' bytes), but a step computes nothing: it sleeps
for the time a cost model fitted to a measured profile says the step would take on the GPU, and
its logits put every row on one ordinary token (so requests run to max_tokens).

A profile is a bench record (bench/results/h200-engine*.json: `decode` rows of concurrency,
context and step_ms; `prefill_tok_s` by prompt length). The fit, by least squares:

    decode step (s) = a + b * rows + c * sum of the rows' contexts
    prefill (s)     = prompt rows / prefill tokens per second (the profile's best)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.parallel.group import SINGLE
from dsaserve.engine.step import StepInputs


@dataclass(frozen=True)
class CostModel:
    base_s: float
    per_row_s: float
    per_context_token_s: float
    prefill_tokens_per_s: float

    @classmethod
    def from_profile(cls, path: str | os.PathLike) -> CostModel:
        with open(path) as f:
            record = json.load(f)
        rows = [r for r in record["decode"] if r.get("config", "dsaserve") == "dsaserve"]
        if len(rows) < 3:
            raise ValueError(f"{path}: a profile needs 3 or more decode rows, got {len(rows)}")
        x = torch.tensor(
            [[1.0, r["concurrency"], r["concurrency"] * r["context"]] for r in rows],
            dtype=torch.float64,
        )  # [n, 3]
        y = torch.tensor([[r["step_ms"] / 1e3] for r in rows], dtype=torch.float64)  # [n, 1]
        a, b, c = (max(0.0, float(v)) for v in torch.linalg.lstsq(x, y).solution[:, 0])
        prefill = max(float(v) for v in record["prefill_tok_s"].values())
        return cls(a, b, c, prefill)

    def step_s(self, prefill_rows: int, decode_contexts: list[int]) -> float:
        """Seconds one step takes: its prompt rows and its decode rows' contexts."""
        decode = 0.0
        if decode_contexts:
            rows, context = len(decode_contexts), sum(decode_contexts)
            decode = self.base_s + self.per_row_s * rows + self.per_context_token_s * context
        return decode + prefill_rows / self.prefill_tokens_per_s


class SimulatedModel(torch.nn.Module):
    """What the runner asks of a model (engine.runner.Model), computing nothing."""

    tp = SINGLE

    def __init__(self, cost: CostModel, vocab_size: int, token_id: int) -> None:
        super().__init__()
        self.cost = cost
        self._row = torch.full((1, vocab_size), -1e4)  # [1, vocab]: every row picks token_id
        self._row[0, token_id] = 0.0

    def forward(self, pool: KVPool, inputs: StepInputs, rows: torch.Tensor) -> torch.Tensor:
        contexts = inputs.positions[: inputs.num_decode].tolist()
        time.sleep(self.cost.step_s(inputs.num_rows - inputs.num_decode, contexts))
        return self._row.expand(len(rows), -1).clone()  # [len(rows), vocab] fp32
