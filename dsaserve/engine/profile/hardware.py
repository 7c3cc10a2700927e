"""What a device can do at best: copy bandwidth and matmul rates, the denominators of the floors.

Figures are what this project measured (the benches record them in bench/results/*.json); for a
device without recorded figures `measure` times them (a 4 GiB copy, an 8192^3 bf16 matmul, the
same with per-tensor FP8 `torch._scaled_mm`). The CPU has none: a profile there reports times
without floors.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    name: str
    copy_GBps: float  # device-to-device copy: bytes read + written per second (1e9)
    bf16_matmul_TFLOPs: float  # dense bf16 GEMM (8192^3)
    fp8_matmul_TFLOPs: float | None = None  # per-tensor FP8 _scaled_mm (8192^3); None: unknown
    source: str = ""  # where the figures come from

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def bytes_per_ms(self) -> float:
        return self.copy_GBps * 1e6

    @property
    def bf16_flop_per_ms(self) -> float:
        return self.bf16_matmul_TFLOPs * 1e9

    @property
    def fp8_flop_per_ms(self) -> float:
        """FP8 matmuls at their own rate where it is known, else at the bf16 rate (a floor
        must not be above the time: the bf16 rate is the slower one)."""
        return (self.fp8_matmul_TFLOPs or self.bf16_matmul_TFLOPs) * 1e9


# The best of each figure measured on one H200 (torch 2.11, CUDA 13): a floor divides by it.
H200 = Hardware(
    name="NVIDIA H200",
    copy_GBps=4268.5,  # bench/results/h200-engine-256.json (4226-4269 over four runs)
    bf16_matmul_TFLOPs=801.0,  # shared/reference/gpu-anchors.md (691-801 over four runs)
    fp8_matmul_TFLOPs=1300.6,  # bench/results/h200-quant.json
    source="measured on an H200: bench/results/h200-engine-256.json (copy), "
    "shared/reference/gpu-anchors.md (bf16 matmul), bench/results/h200-quant.json (FP8 matmul)",
)
KNOWN = {"H200": H200}  # substring of torch.cuda.get_device_name -> figures


def known(device_name: str) -> Hardware | None:
    """The recorded figures of a device, by (a substring of) its name."""
    return next((hw for key, hw in KNOWN.items() if key in device_name), None)


def for_device(device: torch.device, how: str = "auto") -> Hardware | None:
    """The figures a profile on `device` divides by. how: "auto" (recorded figures of a known
    GPU, else measured), "measure" (always measured) or "none". None on the CPU."""
    if how == "none" or device.type != "cuda":
        return None
    if how == "auto":
        hw = known(torch.cuda.get_device_name(device))
        if hw is not None:
            return hw
    return measure(device)


def median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median ms of `reps` CUDA-event-timed calls of fn, after one warm-up call."""
    fn()  # warm-up (allocation, kernel selection)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_ms(device: torch.device) -> float:
    src = torch.randn(1 << 30, device=device)  # 4 GiB of fp32
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src))


def measure(device: torch.device | str = "cuda") -> Hardware:
    """Time the ceilings on a CUDA device: copy of 4 GiB (bytes read + written), an 8192^3 bf16
    matmul and, where the device has FP8 tensor cores, the same as per-tensor FP8 _scaled_mm."""
    device = torch.device(device)
    copy_ms = _copy_ms(device)
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = median_ms(lambda: a @ b)
    fp8 = None
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        fp8_ms = median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        fp8 = 2 * 8192**3 / fp8_ms / 1e9
    except (RuntimeError, TypeError):  # no FP8 tensor cores (or no _scaled_mm) here
        pass
    return Hardware(
        name=torch.cuda.get_device_name(device),
        copy_GBps=2 * (1 << 32) / copy_ms / 1e6,
        bf16_matmul_TFLOPs=2 * 8192**3 / mm_ms / 1e9,
        fp8_matmul_TFLOPs=fp8,
        source="measured in this run (engine.profile.hardware.measure)",
    )
