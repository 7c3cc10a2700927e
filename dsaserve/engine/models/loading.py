"""Safetensors checkpoints (single file or sharded index) into a family's model, memory-mapped:
what every family's loader shares. A family says how its checkpoint names map onto its
parameters (`Target`); this module reads, checks, converts and copies.

Formats: dense tensors (bf16, fp32, int64) are cast to their parameter's dtype. Quantized ones,
FP8 e4m3 or FP4 e2m1 pairs in int8, each with its block scale (`<name>.scale`, or HF's
`<name>.weight_scale_inv`), are copied unchanged into the parameters that keep them (FP8 / FP4
dtypes), or dequantized (kernels.quant, exact) into dense ones. Scales are ue8m0 (the DeepSeek-V4
release stores them so, as float8_e8m0fnu or its raw bytes) or fp32 powers of two (DeepSeek-V3.2's
`weight_scale_inv` under `scale_fmt: ue8m0`), which convert to ue8m0 exactly; fp32 scales that are
not powers of two (DeepSeek-V3's format) are refused by name.

Tensor parallel: a parameter marked by engine.parallel.group.shard holds this rank's slice of
the checkpoint tensor along one dim (read as a slice, so a rank never holds the whole tensor;
quantized codes and their block scales are cut at the same block boundary, dequantized ones are
cut after dequantization); stacked experts marked by shard_experts take only their range.

A model's optional modules (its draft heads: the multi-token-prediction layers `mtp`, a DSpark
head; `optional_modules`) load when the checkpoint has any of their tensors; a checkpoint without
them drops them from the model, and the tensors of one the model did not build are not read.
Anything else missing, unexpected, mis-shaped or in the wrong format is reported in one error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from safetensors import safe_open
from tqdm import tqdm

from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.kernels.quant import FP8_BLOCK, dequantize_fp4, dequantize_fp8_blocks

log = logging.getLogger(__name__)

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_QUANTIZED = (torch.float8_e4m3fn, torch.int8)  # parameter dtypes that hold checkpoint codes
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", torch.int8)  # the V4 release's converted FP4 dtype
_STACKED = {"w13": ("w1", "w3"), "s13": ("w1", "w3"), "w2": ("w2",), "s2": ("w2",)}


class WeightsError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


class LoadableModel(Protocol):
    """What the loader reads of a family's model besides its parameters."""

    tp: TensorParallel
    # dotted names of submodules dropped when not stored (a ModuleList is emptied, a module
    # set to None); their tensors are skipped where the model has none
    optional_modules: tuple[str, ...]

    def state_dict(self, *, keep_vars: bool) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter (or buffer) of ours and the slice of it."""

    param: str
    index: tuple = ()  # sub-slice of it that this checkpoint tensor fills
    source: str = ""  # the checkpoint name in canonical spelling, as missing-tensor errors show it

    def scale(self, rows_per_scale: int = 1) -> Target:
        """Where the scale of this (quantized) weight goes when the model keeps it quantized;
        rows_per_scale: weight rows one scale row covers (stacked FP8 experts: 128), which cuts
        the rows of a stacked expert's slice down to its scale rows."""
        for codes, scales in ((".experts.w13", ".experts.s13"), (".experts.w2", ".experts.s2")):
            if self.param.endswith(codes):
                param = self.param.removesuffix(codes) + scales
                break
        else:
            param = self.param.removesuffix(".weight") + ".scale"
        index = self.index
        if len(index) == 2 and isinstance(index[1], slice):
            rows = index[1]
            index = (index[0], slice(rows.start // rows_per_scale, rows.stop // rows_per_scale))
        return Target(param, index, self.source.removesuffix(".weight") + ".scale")


def expert_target(prefix: str, expert: int, proj: str, inter: int) -> Target:
    """Checkpoint tensor `<prefix>.<expert>.<proj>.weight` (proj w1 = gate, w2 = down, w3 = up)
    in the stacked experts `<prefix>.w13` [E, gate | up, hidden] / `<prefix>.w2` [E, ...]."""
    source = f"{prefix}.{expert}.{proj}.weight"
    if proj == "w2":
        return Target(f"{prefix}.w2", (expert,), source)
    rows = slice(0, inter) if proj == "w1" else slice(inter, 2 * inter)
    return Target(f"{prefix}.w13", (expert, rows), source)


def expected_sources(param: str, num_experts: int) -> list[str]:
    """The canonical checkpoint names that together fill `param`."""
    prefix, _, leaf = param.rpartition(".")
    if prefix.endswith(".experts") and leaf in _STACKED:
        kind = "weight" if leaf.startswith("w") else "scale"
        return [f"{prefix}.{e}.{w}.{kind}" for e in range(num_experts) for w in _STACKED[leaf]]
    return [param]


def checkpoint_files(model_dir: str | os.PathLike) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


M = TypeVar("M", bound=torch.nn.Module)


def build(
    model_cls: Callable[[Any, Any, TensorParallel], M],
    cfg: Any,
    dtype: torch.dtype,
    device: torch.device,
    quantized: bool,
    tp: TensorParallel,
) -> M:
    """A family's model allocated directly in its run-time dtypes on `device` (weights empty
    until loaded): model_cls(cfg, the checkpoint's quantization if `quantized` else None, tp),
    in eval mode without gradients. Raises ConfigError for quantized compute of a dense
    checkpoint and for a tensor-parallel size the model does not split into."""
    if quantized and cfg.quantization is None:
        raise ConfigError(
            "quantized compute needs a quantized checkpoint; config.json has no "
            "`quantization_config`"
        )
    cfg.check_tensor_parallel(tp.size, fp8=quantized)
    with torch.device(device), default_dtype(dtype):
        model = model_cls(cfg, cfg.quantization if quantized else None, tp)
    return model.requires_grad_(False).eval()


def load_checkpoint(
    model: LoadableModel,
    model_dir: str | os.PathLike,
    *,
    target: Callable[[str], Target],
    skip: Callable[[str], bool],
    num_experts: int,
    tie_word_embeddings: bool,
    fp8_block: int = FP8_BLOCK,
) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, or raise WeightsError.

    target: a checkpoint name -> where it goes; skip: names read by nobody (copies of shared
    tensors, parts not served); num_experts: routed experts a stacked-experts parameter holds in
    the checkpoint; fp8_block: its FP8 weights' block (a weight dequantized at load may also have
    the releases' 128-blocks: DeepSeek-V4.1's wo_a)."""
    files = checkpoint_files(model_dir)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        keys = {key: h for h in handles for key in h.keys()}
        params = [target(k).param for k in keys if not skip(k)]
        absent = []  # prefixes of optional modules the model has not (or no longer)
        for name in model.optional_modules:
            prefix = name + "."
            parent, _, leaf = name.rpartition(".")
            owner: Any = model
            for part in parent.split(".") if parent else ():
                owner = getattr(owner, part, None)
            module = getattr(owner, leaf, None)
            if (
                module is not None
                and len(list(module.parameters()))
                and not any(p.startswith(prefix) for p in params)
            ):
                log.info("the checkpoint stores no %s tensors: not loaded", name)
                empty = isinstance(module, torch.nn.ModuleList)
                setattr(owner, leaf, torch.nn.ModuleList() if empty else None)
                module = None
            if module is None or not len(list(module.parameters())):
                absent.append(prefix)
        loader = _Loader(model, keys, target, skip, fp8_block, tuple(absent))
        total = sum(os.path.getsize(f) for f in files)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < 2**30
        ) as bar:
            for h in handles:  # shard by shard: each file's pages are read once, in order
                for key in h.keys():
                    bar.update(loader.load(key))
    if tie_word_embeddings and "head.weight" not in loader.filled:
        if "embed.weight" in loader.filled:
            with torch.no_grad():
                loader.state["head.weight"].copy_(loader.state["embed.weight"])
            loader.filled.add("head.weight")
    missing = [
        s for k in loader.state for s in expected_sources(k, num_experts) if s not in loader.filled
    ]
    if missing or any(loader.problems.values()):
        raise WeightsError(_report(model_dir, {"missing": missing, **loader.problems}))


class _Loader:
    """Copies checkpoint tensors into a model's parameters, one weight (and its scale) a call."""

    def __init__(
        self,
        model: LoadableModel,
        keys: dict,
        target: Callable[[str], Target],
        skip: Callable[[str], bool],
        fp8_block: int,
        absent: tuple[str, ...],
    ) -> None:
        """absent: parameter prefixes of optional modules the model does not have."""
        self.tp, self.target, self.skip, self.absent = model.tp, target, skip, absent
        self.fp8_block = fp8_block
        # parameters and persistent buffers (not the tables a module computes, as RoPE's)
        self.state: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        self.keys = keys  # checkpoint name -> the open file holding it
        self.scale_of = {
            key.removesuffix(suffix) + ".weight": key
            for key in keys
            for suffix in SCALE_SUFFIXES
            if key.endswith(suffix) and key.removesuffix(suffix) + ".weight" in keys
        }
        self.scales = set(self.scale_of.values())
        self.filled: set[str] = set()  # checkpoint names (canonical) copied into the model
        self.problems: dict[str, list[str]] = {
            "unexpected": [],
            "wrong shape": [],
            "wrong format": [],
        }

    def load(self, key: str) -> int:
        """Load checkpoint tensor `key` (a scale loads with its weight); returns bytes read."""
        if key in self.scales or self.skip(key):
            return 0
        target = self.target(key)
        if target.param.startswith(self.absent):  # (config.json turned that head off)
            return 0
        param = self.state.get(target.param)
        if param is None:
            self.problems["unexpected"].append(key)
            return 0
        self.filled.add(target.source)  # present (if wrong, reported once below)
        scale_key = self.scale_of.get(key)
        if hasattr(param, "tp_experts"):  # stacked experts: only this rank's range
            first, stop = param.tp_experts
            if not first <= target.index[0] < stop:
                if scale_key is not None and param.dtype in _QUANTIZED:
                    self.filled.add(target.scale().source)
                return 0
            target = dataclasses.replace(target, index=(target.index[0] - first, *target.index[1:]))
        dest = param[target.index] if target.index else param
        dim = getattr(param, "tp_dim", None)
        if dest.dtype in _QUANTIZED:
            return self._copy_quantized(key, scale_key, target, dest, dim)
        codes = self.keys[key].get_slice(key)
        shape, fmt = list(codes.get_shape()), codes.get_dtype()
        if scale_key is None and fmt in ("F8_E4M3", "I8"):
            self.problems["wrong format"].append(f"{key}: {fmt} without a scale")
            return 0
        if scale_key is not None and fmt != "F8_E4M3":
            shape[-1] *= 2  # FP4: two codes a byte
        if not self._shape_ok(key, shape, dest, dim):
            return 0
        if scale_key is None:  # dense: read only this rank's slice
            tensor = self._read(key, dim)
            read = tensor.numel() * tensor.element_size()
        else:  # quantized into a dense parameter: dequantize whole, then cut
            tensor = self.keys[key].get_tensor(key)
            raw_scale = self.keys[scale_key].get_tensor(scale_key)
            read = tensor.numel() * tensor.element_size() + raw_scale.nbytes
            try:
                scale = as_e8m0(raw_scale)
                tensor = self._part(_dequantize(tensor, scale, self.fp8_block), dim)
            except (AssertionError, ValueError) as e:
                self.problems["wrong format"].append(f"{key}: {e}")
                return read
        with torch.no_grad():
            dest.copy_(tensor)
        return read

    def _shape(self, key: str) -> list[int]:
        return list(self.keys[key].get_slice(key).get_shape())

    def _part(self, tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor along `dim` (all of it if None)."""
        if dim is None:
            return tensor
        start, stop = self.tp.span(tensor.shape[dim])
        return tensor.narrow(dim, start, stop - start)

    def _read(self, key: str, dim: int | None) -> torch.Tensor:
        """Checkpoint tensor `key`, or only this rank's slice of it along `dim`, read alone."""
        if dim is None:
            return self.keys[key].get_tensor(key)
        part = self.keys[key].get_slice(key)
        cut = [slice(None)] * (dim + 1)
        cut[dim] = slice(*self.tp.span(part.get_shape()[dim]))
        return part[tuple(cut)]

    def _copy_quantized(
        self, key: str, scale_key: str | None, target: Target, dest: torch.Tensor, dim: int | None
    ) -> int:
        """The model keeps this weight quantized: copy its codes and scale (this rank's blocks
        of both, when split along `dim`) unchanged."""
        tensor = self._read(key, dim)
        if dest.dtype == torch.int8 and tensor.dtype in (torch.uint8, _FP4_X2):
            tensor = tensor.view(torch.int8)  # FP4 pairs, whatever the byte type says
        if scale_key is None or tensor.dtype != dest.dtype:
            want = "FP8 e4m3" if dest.dtype == torch.float8_e4m3fn else "FP4 (int8)"
            self.problems["wrong format"].append(
                f"{key}: {tensor.dtype}{'' if scale_key else ' without a scale'}; the model "
                f"keeps it {want} (turn quantized compute off to dequantize at load)"
            )
            return 0
        codes_param = self.state[target.param]
        scale_param = self.state[target.scale().param]
        stacked = codes_param.dim() == 3  # stacked experts: scale rows per weight row
        per = codes_param.shape[1] // scale_param.shape[1] if stacked else 1
        scale_target = target.scale(per)
        scale_dest = self.state[scale_target.param]
        scale_dest = scale_dest[scale_target.index] if scale_target.index else scale_dest
        self.filled.add(scale_target.source)
        if not (
            self._shape_ok(key, self._shape(key), dest, dim)
            and self._shape_ok(scale_key, self._shape(scale_key), scale_dest, dim)
        ):
            return 0
        try:
            scale = as_e8m0(self._read(scale_key, dim))
        except ValueError as e:
            self.problems["wrong format"].append(f"{scale_key}: {e}")
            return 0
        with torch.no_grad():
            dest.copy_(tensor)
            scale_dest.copy_(scale)
        return tensor.numel() * tensor.element_size() + scale.numel()

    def _shape_ok(
        self, key: str, shape: list[int], dest: torch.Tensor, dim: int | None = None
    ) -> bool:
        """Whether checkpoint `shape` fills `dest` (of which this rank holds 1/size along dim)."""
        want = list(dest.shape)
        if dim is not None:
            want[dim] *= self.tp.size
        if shape == want:
            return True
        self.problems["wrong shape"].append(f"{key}: checkpoint {shape}, model expects {want}")
        return False


def as_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 block scales from their stored form: float8_e8m0fnu, its raw bytes (U8), or fp32
    powers of two (exact). Raises ValueError for fp32 scales that are not powers of two."""
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    if scale.dtype in (torch.float32, torch.bfloat16):
        mantissa, _ = torch.frexp(scale.float())
        if not bool((mantissa == 0.5).all()):
            raise ValueError(
                f"{scale.dtype} scales that are not all positive powers of two (DeepSeek-V3's "
                "format); this engine reads ue8m0 scales (quantization_config.scale_fmt: ue8m0)"
            )
        return scale.float().to(torch.float8_e8m0fnu)
    return scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values of an FP8 block-scaled (`block`-blocks, or 128 where the scale's shape says
    so) or FP4 (int8 pairs) weight."""
    if codes.dtype == torch.float8_e4m3fn:
        n, k = codes.shape
        fits = [b for b in (block, FP8_BLOCK) if tuple(scale.shape) == (-(-n // b), -(-k // b))]
        return dequantize_fp8_blocks(codes, scale, fits[0] if fits else block)
    if codes.dtype in (torch.int8, torch.uint8, _FP4_X2):
        return dequantize_fp4(codes.view(torch.int8), scale)
    raise ValueError(f"{codes.dtype} with a scale is neither FP8 e4m3 nor FP4")


def _report(model_dir: str | os.PathLike, problems: dict[str, list[str]]) -> str:
    lines = [f"checkpoint in {model_dir} does not match its config.json:"]
    for title, items in problems.items():
        if items:
            shown = ", ".join(items[:12]) + (
                f", ... ({len(items) - 12} more)" if len(items) > 12 else ""
            )
            lines.append(f"  {title} ({len(items)}): {shown}")
    return "\n".join(lines)
