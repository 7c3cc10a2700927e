"""Run decode steps under torch.profiler and turn what it saw into engine.profile.attribution's
records: CPU ops with their innermost part (CPU), device kernels and the ranges' spans on the
device timeline (GPU). Also counts the routed experts each MoE layer's gate picks, for the
floors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from dsaserve.engine.models.deepseek_v4.moe import MoE
from dsaserve.engine.profile.attribution import (
    OTHER,
    Cells,
    CpuOp,
    Kernel,
    Span,
    attribute_cpu,
    attribute_device,
    range_part,
)
from dsaserve.engine.profile.floors import ExpertLoad
from dsaserve.engine.profile.ranges import PREFIX, WHOLE


@dataclass
class StepProfile:
    """Mean over the profiled steps: (part, class) -> ms, the wall time they add up to, and
    each MoE layer's routed-expert load on this rank."""

    cells: Cells
    wall_ms: float
    steps: int
    experts: list[ExpertLoad] = field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_events(events: Iterable[Any]) -> list[Any]:  # torch FunctionEvents
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]


def op_parts(events: Iterable[Any]) -> dict[int, tuple[str, str | None]]:
    """Each CPU op's (FunctionEvent's) innermost part, by id: its own range, or its nearest
    enclosing one, or OTHER; and the WHOLE part enclosing it (or itself), if any."""
    parts: dict[int, tuple[str, str | None]] = {}
    for e in sorted(_cpu_events(events), key=lambda e: e.time_range.start):  # parents first
        parent = e.cpu_parent
        outer, whole = parts.get(parent.id, (OTHER, None)) if parent else (OTHER, None)
        part = range_part(e.name) or outer
        parts[e.id] = (part, whole or (part if part in WHOLE else None))
    return parts


def cpu_ops(events: Iterable[Any]) -> list[CpuOp]:
    """The CPU ops of a profile (FunctionEvents) with their self times and parts."""
    parts = op_parts(events)
    return [CpuOp(e.name, e.self_cpu_time_total, *parts[e.id]) for e in _cpu_events(events)]


def _not_work(name: str) -> bool:
    """Device-side records that are no kernel or copy: the profiler's own overhead, and sync
    waits (with torch.profiler's experimental sync events on), which overlap the kernels."""
    low = name.lower()
    return "overhead" in low or low.endswith(" sync")


def device_records(prof: torch.profiler.profile) -> tuple[list[Kernel], list[Span]]:
    """The device activities of a profile (kernels, copies), each with the part of the op that
    launched it where the profiler linked the two, and the ranges' spans on the device."""
    part_by_op = op_parts(prof.events())  # a CPU op's id is its correlation id
    kernels, spans = [], []
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    assert results is not None, "a profile that has run (its kineto results)"
    for ev in results.events():
        if ev.device_type() == torch.autograd.DeviceType.CPU or _not_work(ev.name()):
            continue
        start = ev.start_ns() / 1e3
        end = start + ev.duration_ns() / 1e3
        if ev.name().startswith(PREFIX):
            part = range_part(ev.name())
            if part is not None:
                spans.append(Span(part, start, end))
            continue
        linked = ev.linked_correlation_id()
        part, whole = part_by_op.get(linked, (None, None)) if linked else (None, None)
        kernels.append(Kernel(ev.name(), start, end, part, whole))
    return kernels, spans


class ExpertCounter:
    """Hooks on every MoE layer's gate: the experts of this rank each step's tokens pick (the
    decoder layers', not the MTP layer's: a profiled step does not draft)."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = cast(torch.nn.Module, model.layers)
        self.moes = [m for m in layers.modules() if isinstance(m, MoE)]
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.moes]
        self.hooks = [
            moe.gate.register_forward_hook(
                lambda module, args, out, i=i: self.ids[i].append(out[0].detach())
            )
            for i, moe in enumerate(self.moes)
        ]

    def close(self) -> list[ExpertLoad]:
        """Remove the hooks; the mean load per step of each layer."""
        for h in self.hooks:
            h.remove()
        loads = []
        for moe, ids in zip(self.moes, self.ids, strict=True):
            local = next(iter(moe.experts.parameters())).shape[0]
            hit = pairs = 0.0
            for step_ids in ids:
                mine = step_ids - moe.first_expert
                mine = mine[(mine >= 0) & (mine < local)]
                hit += mine.unique().numel()
                pairs += mine.numel()
            steps = max(1, len(ids))
            loads.append(ExpertLoad(experts=hit / steps, pairs=pairs / steps))
        return loads


def profile_steps(
    step: Callable[[], object], model: torch.nn.Module, device: torch.device, steps: int
) -> StepProfile:
    """Run `step` 1 + `steps` times under torch.profiler (CPU, and CUDA on a GPU; the caller
    makes the steps eager: replayed graphs hide their kernels) and attribute each step's time.
    The first step is a warm-up, not counted: the profiler's own start-up, and the eager
    shapes' compilation or autotuning apart from the graphs'."""
    device = torch.device(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities):
        step()
        sync(device)
    total: Cells = {}
    wall_ms = 0.0
    counter = ExpertCounter(model)
    try:
        for _ in range(steps):
            sync(device)
            with torch.profiler.profile(activities=activities) as prof:
                t0 = time.perf_counter()
                step()
                sync(device)
                wall_us = (time.perf_counter() - t0) * 1e6
            if device.type == "cuda":
                cells = attribute_device(*device_records(prof), wall_us)
            else:
                cells = attribute_cpu(cpu_ops(prof.events()), wall_us)
            for key, us in cells.items():
                total[key] = total.get(key, 0.0) + us / 1e3
            wall_ms += wall_us / 1e3
    finally:
        experts = counter.close()
    return StepProfile(
        cells={k: v / steps for k, v in total.items()},
        wall_ms=wall_ms / steps,
        steps=steps,
        experts=experts,
    )
