"""What every GPU bench here shares: timing, ceilings, failures that do not stop a run, and the
run records (JSON in bench/results/).

- Timing: median milliseconds per call of CUDA-event-timed CUDA-graph replays (`time_ms`;
  plain launches where a graph cannot be captured, `time_ms_any`); one timed unit calls the
  function once per argument set, so rotating inputs keep weights and KV out of L2. `Env` is a
  run's device and modes; `timed` is `time_ms_any` that a --smoke run skips.
- Ceilings: the copy bandwidth and matmul rates every floor is divided by, measured now by
  engine.profile.hardware (what `dsaserve profile` divides by too: the engine keeps them, the
  benches import them, never the reverse).
- Run records: `prologue` is what every record states first (the command, the machine, torch's
  and triton's versions), `read_record` the record a rerun adds to, `write_record` writes a
  bench's JSON after each section, so a run cut short keeps what it measured. (How far an
  output lies from its reference, for records and tests alike: bench.compare.rel_err.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from dsaserve.engine.profile import hardware

BUDGET_MS = 200.0  # timed replays per measurement: about this long
MAX_REPS = 200


@dataclasses.dataclass
class Env:
    device: torch.device
    smoke: bool  # CPU: tiny shapes through the same code, nothing timed
    quick: bool
    budget_ms: float = 100.0


def time_ms(
    fn: Callable[..., object],
    arg_sets: list[tuple],
    *,
    graph: bool = True,
    budget_ms: float = BUDGET_MS,
) -> float:
    """Median ms per call; one timed unit calls fn once per arg set (rotating inputs), replayed
    as one CUDA graph (graph=False: plain launches)."""
    fn(*arg_sets[0])  # compile / warm up outside any capture
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for args in arg_sets:
                fn(*args)
        unit: Callable[[], object] = g.replay
    else:

        def unit() -> None:
            for args in arg_sets:
                fn(*args)

    once = hardware.median_ms(unit, reps=1)  # (after a warm-up replay)
    reps = int(min(MAX_REPS, max(5, budget_ms / max(once, 1e-3))))
    return hardware.median_ms(unit, reps) / len(arg_sets)


def time_ms_any(
    fn: Callable[..., object], arg_sets: list[tuple], *, budget_ms: float = BUDGET_MS
) -> tuple[float, str]:
    """time_ms over graph replays, or over plain launches where the capture fails; and which
    ("graph" or "eager")."""
    try:
        return time_ms(fn, arg_sets, budget_ms=budget_ms), "graph"
    except Exception as e:
        print(f"    (graph capture failed: {type(e).__name__}: {str(e)[:160]}; eager)", flush=True)
        torch.cuda.synchronize()
        return time_ms(fn, arg_sets, graph=False, budget_ms=budget_ms), "eager"


def timed(env: Env, fn: Callable[..., object], arg_sets: list[tuple]) -> tuple[float, str]:
    """time_ms_any within the run's budget; a --smoke run calls fn once and times nothing."""
    if env.smoke:
        fn(*arg_sets[0])
        return float("nan"), "smoke"
    return time_ms_any(fn, arg_sets, budget_ms=env.budget_ms)


def kernel_breakdown(fn: Callable[..., object], args: tuple, calls: int = 20) -> dict[str, float]:
    """us per call of each CUDA kernel that fn launches (torch profiler over `calls` calls);
    prints the four longest."""
    fn(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if total > 0:
            out[e.key[:60]] = total / calls
    for name, us in sorted(out.items(), key=lambda kv: -kv[1])[:4]:
        print(f"    {us:9.1f} us  {name}")
    return out


def launches(fn: Callable[..., object], args: tuple, kwargs: dict) -> float:
    """Device operations (kernels, copies, memsets) one call issues, from the profiler."""
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    calls = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
    count = sum(
        e.count
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) > 0
    )
    return count / calls


def ceilings(device: torch.device, smoke: bool = False) -> dict[str, float]:
    """Copy bandwidth (bytes read + written), bf16 matmul and per-tensor FP8 _scaled_mm rates,
    measured now (engine.profile.hardware.measure); NaN in a --smoke run."""
    if smoke:
        return dict.fromkeys(("copy_GBps", "bf16_matmul_TFLOPs", "fp8_scaled_mm_TFLOPs"), math.nan)
    hw = hardware.measure(device)
    return {
        "copy_GBps": hw.copy_GBps,
        "bf16_matmul_TFLOPs": hw.bf16_matmul_TFLOPs,
        "fp8_scaled_mm_TFLOPs": hw.fp8_matmul_TFLOPs or math.nan,
    }


def attempt(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one measurement; on failure print it and return {"error": what} (the run goes on)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        print(f"  FAILED {label}: {msg[:400]}", flush=True)
        traceback.print_exc(limit=4, file=sys.stdout)
        return {"error": msg[:1000]}


def fmt(v: object, spec: str = "8.1f") -> str:
    """A number for a printed table, "-" (as wide) where it is missing or NaN."""
    if isinstance(v, (int, float)) and not math.isnan(v):
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0]) if spec[0].isdigit() else 1)


def command() -> str:
    """This process's command line as a run record states it: `python -m bench.quant --only fp8`
    (a bench run as a module), else the script's path."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = f"python -m {spec.name.removesuffix('.__main__')}" if spec else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def prologue(device: torch.device | str) -> dict[str, Any]:
    """What a run record says first: the command that made it, the machine (the device's name
    and multiprocessor count; "cpu" and 0 without CUDA), torch's and triton's versions."""
    import triton

    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = "cpu", 0
    return {
        "command": command(),
        "device": name,
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def read_record(path: str | os.PathLike | None) -> dict:
    """The run record at `path`, for a rerun to add to; {} where there is none."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_record(path: str | os.PathLike | None, record: dict, indent: int = 1) -> None:
    """Write a run record as JSON at `path` (its folder made); nothing without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=indent, default=str)
        f.write("\n")
