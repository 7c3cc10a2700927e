"""Who spent a profiled step's time: each op or kernel -> (model part, kernel class).

Pure functions over plain records (engine.profile.capture makes them from torch.profiler), so
the rules are testable with synthetic events.

Parts are the `engine.profile.ranges` ranges (`PARTS`), plus OTHER (work outside every range) and
HOST (step time that no kernel (GPU) or op (CPU) covers: the device waiting for the host, or
Python between ops). A kernel's part is, in this order of trust:

1. the innermost range of the op that launched it, where the profiler linked the two (torch ops);
2. the innermost range whose span on the device timeline contains it (the profiler draws each
   range as an annotation over the kernels linked to it). Triton launches are linked to no op,
   but run between torch kernels of the same range: the FP4 MoE kernels, inside `moe`;
3. refined by name: a kernel known to belong to a part (`PART_OF_KERNEL`) goes there when that
   part is the one found or lies inside it (a sparse-MLA kernel in `attention` is in
   `sparse_mla`; a range of Triton launches only has no annotation of its own); a name that
   points outside the part found (the compressor kernel inside `indexer`: the indexer's own
   compressor) does not move it;
4. inside a WHOLE part (`draft`: a draft head's layers), that part, its class still the one the
   innermost part gives.

Classes: communication (NCCL kernels, gloo / c10d ops), attention (the sparse-MLA kernel, and
everything under `sparse_mla`), indexer (scoring + top-k, everything under `indexer_topk`), moe
(the FP4 expert kernels, and everything under `moe`: router, grouped GEMMs, shared expert),
gemm (the other matmuls), elementwise (the rest: norms, RoPE, mixes, copies, glue) and host.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from dsaserve.engine.profile.ranges import PARTS, PREFIX, WHOLE

OTHER = "other"  # part: work outside every range
HOST = "host"  # part and class: step time no kernel / op covers
CLASSES = ("gemm", "attention", "indexer", "moe", "elementwise", "communication", HOST)
ALL_PARTS = (*PARTS, OTHER, HOST)

COMMUNICATION_KEYS = (
    "nccl",
    "gloo",
    "c10d::",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
)
GEMM_KERNEL_KEYS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")
GEMM_OPS = frozenset(
    "aten::" + op
    for op in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "matmul",
        "linear",
        "einsum",
        "_scaled_mm",
        "mv",
        "addmv",
        "dot",
    )
)
# Triton kernels (kernels/) by name: their class, and the part they belong to. Names not listed
# (norms, RoPE, activation quantization, the FP8 GEMM) serve several parts.
CLASS_OF_KERNEL = {
    "_sparse_mla_kernel": "attention",
    "_combine_kernel": "attention",
    "_naive_decode_kernel": "attention",
    "_score_kernel": "indexer",
    "_merge_kernel": "indexer",
    "_moe_up_kernel": "moe",
    "_moe_down_kernel": "moe",
}
PART_OF_KERNEL = {
    "_sparse_mla_kernel": "sparse_mla",
    "_combine_kernel": "sparse_mla",
    "_naive_decode_kernel": "sparse_mla",
    "_score_kernel": "indexer_topk",
    "_merge_kernel": "indexer_topk",
    "_indexer_query_kernel": "indexer",
    "_moe_up_kernel": "moe",
    "_moe_down_kernel": "moe",
    "_hc_mix_kernel": "mhc",
    "_hc_finish_kernel": "mhc",
    "_hc_weights_kernel": "mhc",
    "_attention_pre_kernel": "attention",
    "_rope_back_kernel": "attention",
    "_sparse_indices_kernel": "attention",
    "_compress_decode_kernel": "compressor",
}
CLASS_OF_PART = {"sparse_mla": "attention", "indexer_topk": "indexer", "moe": "moe"}


@dataclass(frozen=True)
class Kernel:
    """One device activity of the step (kernel, memcpy, memset); times in µs."""

    name: str
    start: float
    end: float
    part: str | None = None  # the launching op's innermost part (OTHER: none); None: not linked
    whole: str | None = None  # the WHOLE part enclosing the launching op, if any


@dataclass(frozen=True)
class Span:
    """A part's range as the profiler draws it on the device timeline; times in µs."""

    part: str
    start: float
    end: float


@dataclass(frozen=True)
class CpuOp:
    """One op (or range) on the CPU with its self time: its time minus its children's."""

    name: str
    self_us: float
    part: str  # its innermost part (its own, for a range)
    whole: str | None = None  # the WHOLE part enclosing it, if any


Cells = dict[tuple[str, str], float]  # (part, class) -> µs (or ms)


def range_part(name: str) -> str | None:
    """`dsaserve.moe` -> `moe`; None for anything else."""
    if name.startswith(PREFIX):
        part = name.removeprefix(PREFIX)
        return part if part in PARTS else None
    return None


def _kernel_key(name: str) -> str:
    """A Triton kernel's name as the tables list it (the trace may add a suffix or prefix)."""
    return next((k for k in (*CLASS_OF_KERNEL, *PART_OF_KERNEL) if k in name), name)


def kernel_class(name: str, part: str) -> str:
    """The class of a kernel (or CPU op) called `name` that ran in `part`."""
    low = name.lower()
    if any(k in low for k in COMMUNICATION_KEYS):
        return "communication"
    named = CLASS_OF_KERNEL.get(_kernel_key(name))
    if named is not None:
        return named
    if part in CLASS_OF_PART:
        return CLASS_OF_PART[part]
    if name in GEMM_OPS or any(k in low for k in GEMM_KERNEL_KEYS):
        return "gemm"
    return "elementwise"


def within(part: str, outer: str) -> bool:
    """Whether `part` is `outer` or runs inside it (PARTS' nesting)."""
    p: str | None = part
    while p is not None:
        if p == outer:
            return True
        p = PARTS.get(p)
    return False


class Timeline:
    """The ranges of one step on the device timeline; `innermost(t)`: the part whose span
    (the innermost, where they nest) contains time t."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: (s.start, -s.end))
        self.starts = [s.start for s in self.spans]

    def innermost(self, t: float) -> str | None:
        # Nested spans start after their parents: the latest-starting span that still covers t.
        for i in range(bisect.bisect_right(self.starts, t) - 1, -1, -1):
            if self.spans[i].end > t:
                return self.spans[i].part
        return None

    def whole(self, t: float) -> str | None:
        """The WHOLE part whose span contains time t, if any."""
        for i in range(bisect.bisect_right(self.starts, t) - 1, -1, -1):
            if self.spans[i].end > t and self.spans[i].part in WHOLE:
                return self.spans[i].part
        return None


def kernel_part(kernel: Kernel, timeline: Timeline) -> str:
    part = kernel.part if kernel.part not in (None, OTHER) else None
    if part is None:
        part = timeline.innermost((kernel.start + kernel.end) / 2)
    named = PART_OF_KERNEL.get(_kernel_key(kernel.name))
    if named is not None and (part is None or within(named, part)):
        part = named
    return part or kernel.part or OTHER


def attribute_device(kernels: Iterable[Kernel], spans: Iterable[Span], wall_us: float) -> Cells:
    """(part, class) -> µs of one step on a GPU: each kernel's duration, and the rest of the
    step's wall time (the device idle) under (HOST, HOST). Kernels of one stream do not
    overlap; should some (several streams), the idle time is counted as 0."""
    timeline, cells = Timeline(spans), Cells()
    busy = 0.0
    for k in kernels:
        part = kernel_part(k, timeline)
        whole = k.whole or timeline.whole((k.start + k.end) / 2)
        key = (whole or part, kernel_class(k.name, part))
        cells[key] = cells.get(key, 0.0) + (k.end - k.start)
        busy += k.end - k.start
    cells[HOST, HOST] = max(0.0, wall_us - busy)
    return cells


def attribute_cpu(ops: Iterable[CpuOp], wall_us: float) -> Cells:
    """(part, class) -> µs of one step on the CPU: each op's self time under its part and
    class; a range's own self time (Python between its ops) is HOST-class time of its part;
    the rest of the wall time (outside every op) is (HOST, HOST)."""
    cells: Cells = {}
    covered = 0.0
    for op in ops:
        cls = HOST if range_part(op.name) else kernel_class(op.name, op.part)
        key = (op.whole or op.part, cls)
        cells[key] = cells.get(key, 0.0) + op.self_us
        covered += op.self_us
    cells[HOST, HOST] = cells.get((HOST, HOST), 0.0) + max(0.0, wall_us - covered)
    return cells
