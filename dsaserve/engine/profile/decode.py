"""Profile a decode step: time it as it runs, profile it eagerly, set it against its floors.

`profile_decode` works on any step function over a `ModelRunner` (bench/engine.py passes its
own); `profile_engine` runs it on an `LLMEngine` with a synthetic history (`dsaserve profile`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.model import DeepseekV4
from dsaserve.engine.profile import history
from dsaserve.engine.profile.capture import profile_steps, sync
from dsaserve.engine.profile.floors import decode_work
from dsaserve.engine.profile.hardware import Hardware
from dsaserve.engine.profile.report import Report
from dsaserve.engine.rank import keeps_quantized
from dsaserve.engine.runner import ModelRunner

WARMUP_STEPS = 2


def steps_run(steps: int) -> int:
    """Decode steps `profile_decode` takes: warm-up, `steps` timed, one eager warm-up under the
    profiler, `steps` profiled."""
    return WARMUP_STEPS + steps + 1 + steps


def profile_decode(
    step: Callable[[], object],
    runner: ModelRunner,
    *,
    concurrency: int,
    context: int,
    steps: int,
    hardware: Hardware | None,
    setup: dict | None = None,
) -> Report:
    """`step` runs one decode step of `concurrency` requests at about `context` tokens of
    context (each call one token further) on `runner`; it is called `steps_run(steps)` times."""
    device, model = runner.device, runner.model
    assert isinstance(model, DeepseekV4), "the profile knows DeepSeek-V4's parts (floors)"
    for _ in range(WARMUP_STEPS):
        step()
    # Back to back, as served: with async scheduling a step's host work overlaps the one
    # before it on the device, which a sync around each step would hide.
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    graphs = runner.graphs_enabled and any(b >= concurrency for b in runner.graphs)
    was = runner.graphs_enabled
    runner.call("use_graphs", False)  # the profiler sees no kernel of a replayed graph
    try:
        profile = profile_steps(step, model, device, steps)
    finally:
        runner.call("use_graphs", was)
    work = decode_work(model, runner.pool, concurrency, context, profile.experts)
    notes = []
    if runner.tp.size > 1:
        notes.append(
            f"rank 0 of {runner.tp.size}: its kernels, and floors of its shard; communication "
            "has no floor"
        )
    return Report(
        setup={
            **(setup or {}),
            "concurrency": concurrency,
            "context": context,
            "steps": steps,
            "device": str(device),
        },
        step_ms=step_ms,
        step_mode="cuda graphs" if graphs else "eager",
        profile=profile,
        work=work,
        hardware=hardware,
        notes=notes,
    )


def profile_engine(
    engine: LLMEngine,
    *,
    concurrency: int,
    context: int,
    steps: int,
    hardware: Hardware | None,
    seed: int = 0,
) -> Report:
    """Profile the engine's decode step over `concurrency` synthetic requests of `context`
    tokens (engine.profile.history); they are gone afterwards."""
    ids = history.add_decoding_requests(engine, concurrency, context, steps_run(steps), seed)
    try:
        return profile_decode(
            engine.step,
            engine.runner,
            concurrency=concurrency,
            context=context,
            steps=steps,
            hardware=hardware,
            setup={
                "model": os.path.basename(os.path.normpath(engine.model_dir)),
                "dtype": engine.config.dtype,
                "quantized_compute": keeps_quantized(engine.config, engine.model_config),
                "kv_dtype": str(engine.pool.dtype).removeprefix("torch."),
                "tensor_parallel_size": engine.config.tensor_parallel_size,
            },
        )
    finally:
        history.finish(engine, ids)
