"""Decode steps of a DeepSeek-V4 model and every fused glue op's inputs on them, shared by
tests/kernels/test_fused.py (tiny model on CPU, V4-Flash on a GPU) and bench/glue.py.

A GlueStep is a real KVPool and StepState: requests with their pages allocated, rings and pools
holding a random history, rows at chosen positions (decode rows first, then optional prefill
chunks). Each op comes as an `Op`: the arguments of its kernels.fused_dispatch call, which
arguments it writes, and the bytes it must move at least.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.models.deepseek_v4.attention import hca_width
from dsaserve.engine.models.deepseek_v4.compressor import Compressor
from dsaserve.engine.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from dsaserve.engine.models.deepseek_v4.mhc import HyperConnection
from dsaserve.engine.models.deepseek_v4.tiny import tiny_config
from dsaserve.engine.step import RowSpan, StepState, build_step_inputs
from dsaserve.kernels import fused_reference

V4_FLASH = {  # V4-Flash's attention, compressor, indexer and mHC widths; one layer per kind
    "model_type": "deepseek_v4",
    "num_hidden_layers": 3,
    "layer_types": [SLIDING, CSA, HCA],
    "compress_rates": {CSA: 4, HCA: 128},
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
}


def model_config(name: str) -> ModelConfig:
    """ "tiny" (the built-in tiny model: hidden 64, 4 heads x 64, rope 16, index 16 x 32, rates
    4 / 16, window 16) or "v4-flash" (hidden 4096, 64 heads x 512, rope 64, index 64 x 128,
    rates 4 / 128, window 128, hc_mult 4; the other fields at V4-Flash's defaults)."""
    return ModelConfig.from_hf(tiny_config(300) if name == "tiny" else V4_FLASH)


Written = int | tuple[int, str]  # an Op argument, or a field of one


@dataclasses.dataclass
class Op:
    name: str
    fused: Callable  # the kernels.fused_dispatch function
    args: tuple
    kwargs: dict
    # what the op writes into: an arg's index, or (index, field) of a dataclass arg's tensor
    writes: tuple[Written, ...]
    floor_bytes: int  # what any implementation must read and write
    skip_rows: dict[Written, int] = dataclasses.field(
        default_factory=dict
    )  # written arg -> row to ignore
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def reference(self) -> Callable:
        """The engine's torch sequence (kernels.fused_reference): run with no backend forced, its
        row-wise kernels are the engine's (Triton on CUDA, torch on CPU)."""
        return getattr(fused_reference, self.fused.__name__)

    def fresh_args(self) -> tuple:
        """Copies of the arguments, for one call (the op writes into some of them), with the
        originals' strides: the engine hands kernels views (a ring is a slice of slab rows),
        which clone() would make contiguous."""
        return tuple(_fresh(a) for a in self.args)

    def run(self, fn: Callable, backend: str | None = None) -> tuple[Any, list[torch.Tensor]]:
        """fn on fresh copies of the arguments (under `backend`): (result, the written args)."""
        args = self.fresh_args()
        with kernels.use_backend(backend):
            out = fn(*args, **self.kwargs)
        return out, [written(args, w) for w in self.writes]


def written(args: tuple, where: Written) -> torch.Tensor:
    """The tensor `where` names in `args` (an Op's `writes` entry)."""
    if isinstance(where, int):
        return args[where]
    i, name = where
    return getattr(args[i], name)


def _fresh(a: Any) -> Any:
    """A copy of an op argument: tensors copied with their strides, a dataclass of tensors (such
    as kernels.CompressorRows) field by field, anything else as it is."""
    if isinstance(a, torch.Tensor):
        return _strided_copy(a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return dataclasses.replace(
            a, **{f.name: _fresh(getattr(a, f.name)) for f in dataclasses.fields(a)}
        )
    return a


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


class GlueStep:
    """One step of `cfg` on `device`: decode rows at `positions`, then prefill chunks
    (start, rows); the first layer of each kind provides the pool tensors, and one module per
    glue site (random weights) the parameters."""

    def __init__(
        self,
        cfg: ModelConfig,
        positions: list[int],
        *,
        device: str,
        dtype: torch.dtype,
        prefill: tuple[tuple[int, int], ...] = (),
        kv_bytes: int = 16 << 20,
        page_size: int = 4,
        max_position: int | None = None,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """kv_cache_dtype "fp8": FP8 pools (engine.kv.pool), left zeroed (zero bytes read 0.0)."""
        self.cfg, self.dtype, self.dev = cfg, dtype, torch.device(device)
        self.gen = torch.Generator(self.dev).manual_seed(seed)
        contexts = [p + 1 for p in positions] + [s + n for s, n in prefill]
        self.pool = pool = KVPool(
            cfg,
            KVCacheConfig(
                memory_bytes=kv_bytes,
                page_size=page_size,
                max_num_seqs=len(contexts) + 1,
                max_num_batched_tokens=len(positions) + sum(n for _, n in prefill),
                kv_cache_dtype=kv_cache_dtype,
            ),
            dtype=dtype,
            device=self.dev,
            max_context=max(contexts),
        )
        spans = []
        for b, context in enumerate(contexts):
            slab = pool.slab.allocate(1)[0]
            for g, group in pool.groups.items():
                pool.write_page_table(
                    slab, g, 0, group.allocator.allocate(pool.pages_for(g, context))
                )
            start, n = (positions[b], 1) if b < len(positions) else prefill[b - len(positions)]
            spans.append(RowSpan(start, n, slab, [0] * n))
        for t in [t for g in pool.groups.values() for t in (*g.kv.values(), *g.index_k.values())]:
            if t.dtype != torch.uint8:
                t.copy_(self.randn(*t.shape))  # a history: any values will do
        for ring in (*pool.comp_ring.values(), *pool.index_ring.values()):
            for t in ring:
                t.copy_(self.randn(*t.shape))
        self.inp = build_step_inputs(pool, spans, len(positions), self.dev)
        if max_position is not None:  # a CUDA graph's bound (the context limit), not the data's
            self.inp = dataclasses.replace(self.inp, max_position=max_position)
        self.rope = {
            "main": RotaryTable(cfg.rope_main, cfg.rope_dim).to(self.dev),
            "compress": RotaryTable(cfg.rope_compress, cfg.rope_dim).to(self.dev),
        }
        self.step = StepState(pool, self.inp, self.rope)
        self.layer = {kind: cfg.layers_of(kind)[0] for kind in (SLIDING, CSA, HCA)}

    @property
    def num_decode(self) -> int:
        return self.inp.num_decode

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.dev).to(dtype or self.dtype)

    def random_params(self, module: torch.nn.Module) -> torch.nn.Module:
        """module on the device with random parameters: norm weights and scales near 1, biases
        and slot biases around 0, matrices scaled by fan-in."""
        module = module.to(self.dev)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith(("weight", "scale")) and p.dim() == 1:
                    p.copy_(1 + 0.1 * self.randn(*p.shape, dtype=torch.float32))
                elif p.dim() >= 2 and name != "ape":
                    p.copy_(self.randn(*p.shape, dtype=torch.float32) * p.shape[-1] ** -0.5)
                else:
                    p.copy_(0.5 * self.randn(*p.shape, dtype=torch.float32))
        return module

    # ---------------------------------------------------------------- the ops

    def compress(self, kind: str) -> Op:
        """A compressor's decode rows: "csa" (main, overlapping), "index" (the indexer's, 128-d
        at V4-Flash) or "hca"."""
        cfg, pool, D = self.cfg, self.pool, self.num_decode
        layer = self.layer[HCA if kind == "hca" else CSA]
        head_dim = cfg.index_head_dim if kind == "index" else cfg.head_dim
        group = "hca" if kind == "hca" else "csa"
        rate = cfg.compress_rate(layer)
        comp = self.random_params(
            Compressor(cfg.hidden_size, head_dim, rate, kind != "hca", cfg.rms_norm_eps)
        )
        ring = pool.index_ring[layer] if kind == "index" else pool.comp_ring[layer]
        target = (
            pool.groups[group].index_k[layer] if kind == "index" else pool.groups[group].kv[layer]
        )
        trash = pool.index_trash_slot() if kind == "index" else pool.trash_slot(group)
        feats = ring[0].shape[-1]
        pos = self.inp.positions[:D]
        rows = kernels.CompressorRows(
            kv=self.randn(D, feats),
            gate=self.randn(D, feats),
            positions=pos,
            slab=self.inp.slab[:D],
            ring_kv=ring[0],
            ring_gate=ring[1],
            ape=comp.ape,
            norm_weight=comp.norm.weight,
            eps=cfg.rms_norm_eps,
            inv_freq=self.rope["compress"].inv_freq,
            entry_table=self.step.table(group)[:, pool.ring_pages :],
            page_size=pool.page_size,
        )

        closes = int(((pos + 1) % rate == 0).sum())
        esize = ring[0].element_size()
        window = ring[0].shape[1]  # slots a closing window pools (2 * rate with overlap)
        return Op(
            f"compress_{kind}",
            kernels.compress_decode,
            (rows, target, trash),
            {},
            ((0, "ring_kv"), (0, "ring_gate"), 1),
            D * feats * esize * 4 + closes * (window * head_dim * esize * 2 + head_dim * esize),
            skip_rows={1: trash},
            info={"closing_rows": closes},
        )

    def indexer_query(self) -> Op:
        cfg, n = self.cfg, self.inp.num_rows
        heads, head_dim, rate = (
            cfg.index_n_heads,
            cfg.index_head_dim,
            cfg.compress_rate(self.layer[CSA]),
        )
        cos, sin = self.step.rope("compress")

        esize = torch.empty((), dtype=self.dtype).element_size()
        return Op(
            "indexer_query",
            kernels.indexer_query,
            (
                self.randn(n, heads, head_dim),
                self.randn(n, heads),
                cos,
                sin,
                self.inp.positions,
                rate,
            ),
            {},
            (),
            n * heads * (2 * cfg.rope_dim * esize + esize + 4) + n * 12,
        )

    def sparse_indices(self, kind: str) -> Op:
        """The index list of a "swa", "csa" (with random indexer picks) or "hca" layer."""
        cfg, pool, inp, step = self.cfg, self.pool, self.inp, self.step
        group = {SLIDING: "swa", CSA: "csa", HCA: "hca"}[kind]
        W, P = cfg.sliding_window, pool.page_size
        kwargs: dict[str, Any] = dict(
            ring_pages=pool.ring_pages,
            page_size=P,
            scratch_base=pool.entry_slot_base(group),
            window=W,
        )
        extra = 0
        if kind == CSA:
            rate = cfg.compress_rate(self.layer[CSA])
            counts = torch.div(inp.positions + 1, rate, rounding_mode="floor")  # visible entries
            picked = (
                torch.rand(inp.num_rows, cfg.index_topk, generator=self.gen, device=self.dev)
                * counts[:, None]
            ).long()
            picked[torch.rand(picked.shape, generator=self.gen, device=self.dev) < 0.2] = -1
            kwargs["picked"] = picked.to(torch.int32)
            extra = cfg.index_topk
        elif kind == HCA:
            ratio = pool.groups["hca"].ratio
            extra = hca_width(inp.max_position, ratio)
            kwargs.update(hca_ratio=ratio, hca_width=extra)

        return Op(
            f"sparse_indices_{group}",
            kernels.sparse_indices,
            (inp.positions, inp.row_req, inp.req_past, inp.req_row0, step.table(group)),
            kwargs,
            (),
            inp.num_rows * ((W + extra) * 4 + (extra * 4 if kind == CSA else 0) + 8),
        )

    def _hc(self) -> tuple[HyperConnection, RMSNorm]:
        return self.random_params(HyperConnection(self.cfg)), self.random_params(
            RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)
        )

    def _streams(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Streams [N, n, D] and a previous sublayer's (out, post, comb)."""
        n, N, D = self.cfg.hc_mult, self.inp.num_rows, self.cfg.hidden_size
        comb = torch.softmax(self.randn(N, n, n, dtype=torch.float32), dim=-1)
        post = 2 * torch.sigmoid(self.randn(N, n, dtype=torch.float32))
        return self.randn(N, n, D), (self.randn(N, D), post, comb)

    def hc_pre(self, merge: bool) -> Op:
        cfg = self.cfg
        hc, norm = self._hc()
        streams, prev = self._streams()

        N, n, D = streams.shape
        esize = streams.element_size()
        move = N * n * D * esize * (2 if merge else 1) + N * D * esize * (2 if merge else 1)
        return Op(
            "hc_pre_merge" if merge else "hc_pre",
            kernels.hc_pre,
            (
                streams,
                hc.fn,
                hc.base,
                hc.scale,
                norm.weight,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
                cfg.rms_norm_eps,
                prev if merge else None,
            ),
            {},
            (),
            move + hc.fn.numel() * 4 + N * (n + n * n) * 4,
        )

    def hc_merge(self) -> Op:
        streams, (out, post, comb) = self._streams()
        N, n, D = streams.shape
        return Op(
            "hc_merge",
            kernels.hc_merge,
            (streams, out, post, comb),
            {},
            (),
            N * D * streams.element_size() * (2 * n + 1),
        )

    def attention_pre(self) -> Op:
        cfg, step, D = self.cfg, self.step, self.num_decode
        norm = self.random_params(RMSNorm(cfg.head_dim, cfg.rms_norm_eps))
        group, layer = "csa", self.layer[CSA]
        cos, sin = step.rope("compress")
        n, heads = self.inp.num_rows, cfg.num_heads

        esize = torch.empty((), dtype=self.dtype).element_size()
        row = cfg.head_dim * esize
        return Op(
            "attention_pre",
            kernels.attention_pre,
            (
                self.randn(n, heads, cfg.head_dim),
                self.randn(n, cfg.head_dim),
                norm.weight,
                cfg.rms_norm_eps,
                cos,
                sin,
                self.pool.groups[group].kv[layer],
                step.scratch_slots(group),
                step.persist_slots(group)[:D],
            ),
            {},
            (6,),
            n * heads * row * 2 + n * row * 3 + D * row,
        )

    def attention_post(self) -> Op:
        cfg, n = self.cfg, self.inp.num_rows
        cos, sin = self.step.rope("compress")
        esize = torch.empty((), dtype=self.dtype).element_size()
        return Op(
            "attention_post",
            kernels.attention_post,
            (self.randn(n, cfg.num_heads, cfg.head_dim), cos, sin),
            {},
            (),
            n * cfg.num_heads * cfg.rope_dim * esize * 2,
        )

    def ops(self) -> list[Op]:
        """Every fused op of this step."""
        return [
            self.compress("csa"),
            self.compress("index"),
            self.compress("hca"),
            self.indexer_query(),
            self.sparse_indices(SLIDING),
            self.sparse_indices(CSA),
            self.sparse_indices(HCA),
            self.hc_pre(merge=False),
            self.hc_pre(merge=True),
            self.hc_merge(),
            self.attention_pre(),
            self.attention_post(),
        ]


def as_tuple(out: Any) -> tuple:
    """An op's result as a tuple (ops return a tensor, a tuple of tensors and Nones, or None)."""
    return out if isinstance(out, tuple) else (out,)


def paired(op: Op, got: tuple[Any, list], want: tuple[Any, list]) -> list | None:
    """(got, want) tensor pairs to compare: the op's outputs, and of each argument it writes the
    rows `want` changed (op.skip_rows excepted). None if `got` changed any other row."""
    (out_a, w_a), (out_b, w_b) = got, want
    pairs = [(a, b) for a, b in zip(as_tuple(out_a), as_tuple(out_b), strict=True)]
    for i, a, b in zip(op.writes, w_a, w_b, strict=True):
        before = written(op.args, i)
        changed = (b != before).flatten(1).any(dim=1)  # rows the op wrote
        keep = torch.ones_like(changed)
        if i in op.skip_rows:
            keep[op.skip_rows[i]] = False
        if not torch.equal(a[keep & ~changed], before[keep & ~changed]):
            return None
        pairs.append((a[keep & changed], b[keep & changed]))
    return pairs


def compare(op: Op, got: tuple[Any, list], want: tuple[Any, list]) -> float:
    """Largest relative error over paired(op, got, want); inf if integer results differ or
    `got` wrote where `want` did not."""
    pairs = paired(op, got, want)
    if pairs is None:
        return math.inf
    worst = 0.0
    for a, b in pairs:
        if a is None or b is None:
            assert a is None and b is None, "one side returned None"
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return math.inf
            continue
        worst = max(worst, rel_err(a, b))
    return worst
