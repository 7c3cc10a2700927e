"""A decode-step profile as a table and as JSON: per kernel class and per model part, time,
share of the step and floor, then the step against the sum of the floors.

The times are those of the profiled (eager) steps and add up to their wall time, HOST
included; the step compared with the floors is the step as it runs when served (CUDA graphs
replayed where the engine captured them), timed without the profiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsaserve.engine.profile.attribution import ALL_PARTS, CLASSES, HOST
from dsaserve.engine.profile.capture import StepProfile
from dsaserve.engine.profile.floors import Cells as WorkCells
from dsaserve.engine.profile.hardware import Hardware


@dataclass
class Report:
    setup: dict  # what ran: model, device, dtype, concurrency, context, ...
    step_ms: float  # mean of back-to-back steps as served (graphs where captured), no profiler
    step_mode: str  # "cuda graphs" | "eager"
    profile: StepProfile
    work: WorkCells
    hardware: Hardware | None = None
    notes: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- sums

    def _floor(self, keep: Callable[[tuple[str, str]], bool]) -> float | None:
        if self.hardware is None:
            return None
        cells = [w for key, w in self.work.items() if keep(key)]
        return sum(w.ms(self.hardware) for w in cells) if cells else None

    def by(self, axis: int) -> dict[str, dict]:
        """axis 0: by part, 1: by class -> {name: {ms, share, floor_ms}} (parts also list
        their classes), largest first."""
        total = self.profile.wall_ms
        rows: dict[str, dict] = {}
        for key, ms in self.profile.cells.items():
            row = rows.setdefault(key[axis], {"ms": 0.0})
            row["ms"] += ms
            if axis == 0:
                row.setdefault("classes", {})[key[1]] = ms
        for key in self.work:  # a floor without time (a part the step never entered)
            rows.setdefault(key[axis], {"ms": 0.0})
        for name, row in rows.items():
            row["share"] = row["ms"] / total if total else 0.0
            row["floor_ms"] = self._floor(_on(axis, name))
        order = ALL_PARTS if axis == 0 else CLASSES
        return dict(
            sorted(
                rows.items(),
                key=lambda kv: (
                    kv[0] == HOST,
                    -kv[1]["ms"],
                    order.index(kv[0]) if kv[0] in order else len(order),
                ),
            )
        )

    @property
    def floor_ms(self) -> float | None:
        return self._floor(lambda key: True)

    def as_dict(self) -> dict:
        floor = self.floor_ms
        work: dict[str, dict] = {}
        for (part, cls), w in self.work.items():
            work.setdefault(part, {})[cls] = w.as_dict()
        return {
            "setup": self.setup,
            "hardware": self.hardware.as_dict() if self.hardware else None,
            "step_ms": self.step_ms,
            "step_mode": self.step_mode,
            "profiled_step_ms": self.profile.wall_ms,
            "profiled_steps": self.profile.steps,
            "floor_ms": floor,
            "step_over_floor": self.step_ms / floor if floor else None,
            "classes": self.by(1),
            "parts": self.by(0),
            "work": work,
            "routed_experts": [
                {"experts_hit": e.experts, "pairs": e.pairs} for e in self.profile.experts
            ],
            "notes": self.notes,
        }


def _num(v: float | None, fmt: str) -> str:
    """`v` as `fmt` ("9.3f"), or "-" in the same width."""
    return format("-", ">" + fmt.split(".")[0]) if v is None else format(v, fmt)


def _section(title: str, rows: dict[str, dict], total: float, details: bool) -> list[str]:
    out = [f"{title:22s} {'ms':>9s} {'share':>7s} {'floor ms':>9s} {'x floor':>8s}"]
    for name, r in rows.items():
        floor = r["floor_ms"]
        ratio = r["ms"] / floor if floor else None
        line = (
            f"  {name:20s} {r['ms']:9.3f} {100 * r['share']:6.1f}% {_num(floor, '9.3f')} "
            f"{_num(ratio, '8.1f')}"
        )
        if details and len(r.get("classes", {})) > 1:
            parts = sorted(r["classes"].items(), key=lambda kv: -kv[1])
            line += "   " + ", ".join(f"{c} {ms:.3f}" for c, ms in parts)
        out.append(line)
    out.append(f"  {'total':20s} {total:9.3f} {100.0:6.1f}%")
    return out


def format_table(report: Report | dict) -> str:
    """The report as text (from a Report or from its JSON)."""
    d = report.as_dict() if isinstance(report, Report) else report
    s, total = d["setup"], d["profiled_step_ms"]
    tp = s.get("tensor_parallel_size") or 1
    lines = [
        f"decode step of {s.get('model')}: {s.get('concurrency')} requests x "
        f"{s.get('context')} tokens of context, {s.get('device')} {s.get('dtype')}"
        + (f", tensor parallel {tp}" if tp > 1 else ""),
        f"step {d['step_ms']:.3f} ms ({d['step_mode']}, mean of {s.get('steps')} back to "
        f"back); under the profiler {total:.3f} ms (eager, mean of {d['profiled_steps']}), "
        "split below",
    ]
    hw = d["hardware"]
    if hw:
        fp8 = hw.get("fp8_matmul_TFLOPs")
        lines.append(
            f"floors on {hw['name']}: copy {hw['copy_GBps']:.0f} GB/s, bf16 matmul "
            f"{hw['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
            + (f", fp8 matmul {fp8:.0f} TFLOP/s" if fp8 else "")
        )
    else:
        lines.append(f"no hardware figures for {s.get('device')}: times only, no floors")
    lines.append("")
    lines += _section("by kernel class", d["classes"], total, details=False)
    lines.append("")
    lines += _section("by model part", d["parts"], total, details=True)
    lines.append("")
    if d["floor_ms"]:
        lines.append(
            f"step {d['step_ms']:.3f} ms against the sum of floors {d['floor_ms']:.3f} ms: "
            f"{d['step_over_floor']:.2f}x"
        )
    else:
        lines.append(f"step {d['step_ms']:.3f} ms (no floors without hardware figures)")
    lines += [f"note: {n}" for n in d.get("notes", [])]
    return "\n".join(lines)


def _on(axis: int, name: str) -> Callable[[tuple[str, str]], bool]:
    """Whether a (part, class) cell is `name` on `axis` (0: the part, 1: the class)."""
    return lambda key: key[axis] == name
