"""The least work a DeepSeek-V4 decode step must do, per (model part, kernel class), and its
floor in time on a given device: max(bytes / copy bandwidth, FLOPs / matmul rate).

What is counted, for n requests each with `context` tokens in the cache, on this rank's shard:

- the weights of every matrix that runs on the step's rows, with their block scales, read once:
  2 * n FLOPs per weight element (FP8 weights and FP4 experts at the FP8 rate, the rest at the
  bf16 rate); the routed experts only for the experts the step hits (measured in the profiled
  steps, or expected under uniform routing), 2 FLOPs per element per (token, expert) pair;
  the embedding is a gather of n rows and the MTP layers do not run, so neither counts;
- the KV rows each query attends to (`sparse_mla`, class attention): its window, plus the
  indexer's top-k compressed entries (CSA) or every visible one (HCA), read once per query,
  4 * heads * head_dim FLOPs per row (q.k and p.v);
- the indexer's keys of every visible compressed entry (`indexer_topk`, class indexer), read
  once per query, 2 * index_heads * index_head_dim FLOPs per key.

Norms, RoPE, mixes, sampling, communication and activations are not modelled: their classes
get no floor. Each part's floor is the sum of its cells' floors; the floors of consecutive
kernels add, so the sum over all cells is a floor of the step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.models.deepseek_v4.config import CSA, HCA, SLIDING
from dsaserve.engine.models.deepseek_v4.model import DeepseekV4
from dsaserve.engine.models.deepseek_v4.moe import MoE
from dsaserve.engine.profile.hardware import Hardware

_SCALE_DTYPES = (getattr(torch, "float8_e8m0fnu", None),)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.int8)  # FP8 codes, FP4 pairs in int8
_LAYER = re.compile(r"^layers\.\d+\.(\w+)\.")


@dataclass
class Work:
    bytes: float = 0.0
    flops: float = 0.0  # at the bf16 matmul rate
    fp8_flops: float = 0.0  # at the FP8 matmul rate

    def __add__(self, other: Work) -> Work:
        return Work(
            self.bytes + other.bytes, self.flops + other.flops, self.fp8_flops + other.fp8_flops
        )

    def ms(self, hw: Hardware) -> float:
        return max(
            self.bytes / hw.bytes_per_ms,
            self.flops / hw.bf16_flop_per_ms + self.fp8_flops / hw.fp8_flop_per_ms,
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's routed experts in a step, on this rank: experts hit, (token, expert)
    pairs."""

    experts: float
    pairs: float


Cells = dict[tuple[str, str], Work]


def param_part(name: str) -> str | None:
    """The model part (engine.profile.ranges range) a parameter is used in; None: not a step's
    matmul (the embedding, a gather; the MTP layers, which a decode step does not run)."""
    m = _LAYER.match(name)
    if m is None:
        return "head" if name.startswith(("hc_head.", "norm.", "head.")) else None
    sub = m.group(1)
    if sub == "attn":
        if ".attn.indexer." in name:
            return "indexer"
        return "compressor" if ".attn.compressor." in name else "attention"
    if sub in ("hc_attn", "hc_ffn"):
        return "mhc"
    return "moe" if sub == "ffn" else None


def _is_scale(name: str, p: torch.Tensor) -> bool:
    """Block scales: read, never multiplied (Fp8Linear's `scale`, Fp4Experts' `s13`, `s2`)."""
    return p.dtype in _SCALE_DTYPES or name.rsplit(".", 1)[-1] in ("scale", "s13", "s2")


def _matmul_work(name: str, p: torch.Tensor, rows: float) -> Work:
    """Reading `p` once and, unless it is a scale, multiplying `rows` rows by it."""
    if _is_scale(name, p):
        return Work(bytes=p.numel() * p.element_size())
    elements = p.numel() * (2 if p.dtype == torch.int8 else 1)  # FP4: two codes a byte
    flops = 2.0 * rows * elements
    if p.dtype in _FP8_DTYPES:
        return Work(bytes=p.numel() * p.element_size(), fp8_flops=flops)
    return Work(bytes=p.numel() * p.element_size(), flops=flops)


def expected_expert_load(n: int, top_k: int, num_experts: int, local: int) -> ExpertLoad:
    """Uniform routing: an expert is missed by all n tokens with probability (1 - k/E)^n."""
    hit = 1.0 - (1.0 - top_k / num_experts) ** n
    return ExpertLoad(experts=local * hit, pairs=n * top_k * local / num_experts)


def _add(cells: Cells, key: tuple[str, str], work: Work) -> None:
    cells[key] = cells.get(key, Work()) + work


def weight_work(model: DeepseekV4, n: int, experts: Sequence[ExpertLoad] | None = None) -> Cells:
    """The weights' work of a decode step of n rows. experts: per MoE layer (model order), the
    experts hit and pairs on this rank; None: expected under uniform routing."""
    cfg, cells = model.cfg, Cells()
    moes = [ffn for m in model.layers if isinstance(ffn := getattr(m, "ffn", None), MoE)]
    for i, moe in enumerate(moes):
        local = next(iter(moe.experts.parameters())).shape[0]
        load = (
            experts[i]
            if experts is not None
            else expected_expert_load(n, cfg.num_experts_per_tok, cfg.num_experts, local)
        )
        for pname, p in moe.experts.named_parameters():
            per_expert = _matmul_work(pname, p[0], rows=load.pairs)
            _add(
                cells,
                ("moe", "moe"),
                Work(per_expert.bytes * load.experts, per_expert.flops, per_expert.fp8_flops),
            )
    for name, p in model.named_parameters():
        part = param_part(name)
        if part is None or ".ffn.experts." in name or p.dim() < 2 or name.endswith(".ape"):
            continue  # (1-d parameters: norms, biases, sinks, read by elementwise kernels)
        _add(cells, (part, "moe" if part == "moe" else "gemm"), _matmul_work(name, p, rows=n))
    return cells


def row_bytes(pool: KVPool) -> dict[tuple[int, str], float]:
    """(layer, "kv" | "index_k") -> bytes of one slot, from the pool's own regions (whatever
    their format: a region's dim 0 is its pages)."""
    out = {}
    for r in pool.regions():
        parts = r.name.split(".")
        if len(parts) == 3 and parts[2] in ("kv", "index_k"):
            out[int(parts[1]), parts[2]] = r.tensor[0].nbytes / pool.page_size
    return out


def attention_work(model: DeepseekV4, pool: KVPool, n: int, context: int) -> Cells:
    """The KV rows and indexer keys a decode step's queries read, at position `context`."""
    cfg, cells = model.cfg, Cells()
    slot_bytes = row_bytes(pool)
    heads = model.tp.local(cfg.num_heads)
    seen = context + 1  # tokens visible to the query, itself included
    for layer, kind in enumerate(cfg.layer_types):
        rows = min(cfg.sliding_window, seen)
        if kind != SLIDING:
            entries = seen // cfg.compress_rate(layer)
            rows += min(cfg.index_topk, entries) if kind == CSA else entries
            if kind == CSA:
                _add(
                    cells,
                    ("indexer_topk", "indexer"),
                    Work(
                        bytes=n * entries * slot_bytes[layer, "index_k"],
                        flops=2.0 * n * entries * cfg.index_n_heads * cfg.index_head_dim,
                    ),
                )
        assert kind in (SLIDING, CSA, HCA), kind
        _add(
            cells,
            ("sparse_mla", "attention"),
            Work(
                bytes=n * rows * slot_bytes[layer, "kv"],
                flops=4.0 * n * rows * heads * cfg.head_dim,
            ),
        )
    return cells


def decode_work(
    model: DeepseekV4,
    pool: KVPool,
    n: int,
    context: int,
    experts: Sequence[ExpertLoad] | None = None,
) -> Cells:
    """Every modelled cell of a decode step: weights, KV rows and indexer keys."""
    cells = weight_work(model, n, experts)
    for key, work in attention_work(model, pool, n, context).items():
        _add(cells, key, work)
    return cells


def floors_ms(cells: Cells, hw: Hardware) -> dict[tuple[str, str], float]:
    return {key: work.ms(hw) for key, work in cells.items()}
