"""Profiler ranges that name the parts of a forward step (attention, indexer, MoE, ...).

Nearly free without an active profiler, and absent from replayed CUDA graphs; bench/engine.py
attributes every kernel of a profiled step to its innermost range.
"""

from __future__ import annotations

import torch


def profiled(part: str) -> torch.profiler.record_function:
    return torch.profiler.record_function(f"dsaserve.{part}")
