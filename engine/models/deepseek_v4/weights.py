"""Load DeepSeek-V4 safetensors checkpoints (single file or sharded index), memory-mapped.

Names: DeepSeek's release names (`layers.N.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`,
`layers.N.ffn.experts.E.w1.weight`, `mtp.0.e_proj.weight`, ...) and what HF transformers'
`save_pretrained` writes (the same with a `model.` prefix, `embed_tokens`, `hc_head.hc_fn`,
`attn.norm` for the release's `attn.kv_norm`).

Formats: dense tensors (bf16, fp32, int64) are cast to their parameter's dtype. Quantized ones,
FP8 e4m3 or FP4 e2m1 pairs in int8, each with its ue8m0 scale (`<name>.scale`, or HF's
`<name>.weight_scale_inv`), are copied unchanged into the parameters that keep them
(`Fp8Linear`, `Fp4Experts`), or dequantized (kernels.quant, exact) into dense ones: every
weight of a dense model, and always `wo_a` (as the release's convert.py does) and FP8 routed
experts.

Tensor parallel: a parameter marked by engine.parallel.group.shard holds this rank's slice of
the checkpoint tensor along one dim (read as a slice, so a rank never holds the whole tensor;
quantized codes and their block scales are cut at the same block boundary, dequantized ones are
cut after dequantization); stacked experts marked by shard_experts take only their range.

The MTP layers (`mtp.N.*`) load when the checkpoint has any of their tensors; a checkpoint
without them (HF's save_pretrained writes none) drops them from the model, and a config.json
with `num_nextn_predict_layers: 0` skips them. Anything else missing, unexpected, mis-shaped or
in the wrong format is reported in one error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.checkpoint import ConfigError
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.model import DeepseekV4
from engine.models.deepseek_v4.moe import Fp4Experts
from engine.parallel.group import SINGLE, TensorParallel
from kernels.quant import dequantize_fp4, dequantize_fp8_blocks

log = logging.getLogger(__name__)

_RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^lm_head\."), "head."),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"(^|\.)hc_head_(fn|base|scale)$"), r"\1hc_head.\2"),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
    (re.compile(r"\.attn\.norm\."), ".attn.kv_norm."),
    (re.compile(r"\.attn\.wo_a\.weight$"), ".attn.wo_a"),
]
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
# Copies of the shared embedding and head that some MTP exports carry (convert.py skips them).
_SKIP = re.compile(r"^mtp\.\d+\.(emb[^.]*|head)\.")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_QUANTIZED = (torch.float8_e4m3fn, torch.int8)  # parameter dtypes that hold checkpoint codes
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", torch.int8)  # the release's converted FP4 dtype


class WeightsError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter / buffer name
    index: tuple = ()  # sub-slice of it that this checkpoint tensor fills
    source: str = ""  # the checkpoint name it comes from, as missing-tensor errors show it

    def scale(self) -> _Target:
        """Where the scale of this (quantized) weight goes when the model keeps it quantized."""
        for codes, scales in ((".experts.w13", ".experts.s13"), (".experts.w2", ".experts.s2")):
            if self.param.endswith(codes):
                param = self.param.removesuffix(codes) + scales
                break
        else:
            param = self.param.removesuffix(".weight") + ".scale"
        return _Target(param, self.index, self.source.removesuffix(".weight") + ".scale")


def canonical_target(name: str, inter: int) -> _Target:
    """Map a checkpoint weight name onto (our parameter, slice)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    m = _EXPERT.match(name)
    if m:
        prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
        if w == "w2":
            return _Target(f"{prefix}.w2", (e,), name)
        rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)  # w13 = [gate | up]
        return _Target(f"{prefix}.w13", (e, rows), name)
    return _Target(name, (), name)


def _expected_sources(param: str, num_experts: int) -> list[str]:
    """The checkpoint names (release naming) that together fill `param`."""
    prefix, _, leaf = param.rpartition(".")
    if prefix.endswith(".experts") and leaf in ("w13", "s13", "w2", "s2"):
        kind = "weight" if leaf.startswith("w") else "scale"
        parts = ("w1", "w3") if leaf.endswith("13") else ("w2",)
        return [f"{prefix}.{e}.{w}.{kind}" for e in range(num_experts) for w in parts]
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
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantized: bool = False,
    tp: TensorParallel = SINGLE,
) -> DeepseekV4:
    """Allocate the model directly in its run-time dtypes on `device` (weights empty until loaded).

    quantized: keep a quantized checkpoint's FP8/FP4 weights as they are and compute as the
    release does; otherwise every weight is dense in `dtype`. Modules create their fp32
    parameters (norms, sinks, mHC, gate biases, compressor slot biases) explicitly.
    tp: the tensor-parallel group; this rank's shard is built.
    """
    if quantized and cfg.quantization is None:
        raise ConfigError(
            "quantized compute needs a quantized checkpoint; config.json has no "
            "`quantization_config`"
        )
    cfg.check_tensor_parallel(tp.size, fp8=quantized)
    with torch.device(device), _default_dtype(dtype):
        model = DeepseekV4(cfg, cfg.quantization if quantized else None, tp)
    return model.requires_grad_(False).eval()


def load_weights(model: DeepseekV4, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, or raise WeightsError."""
    cfg = model.cfg
    files = checkpoint_files(model_dir)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        keys = {key: h for h in handles for key in h.keys()}
        mtp = [k for k in keys if canonical_target(k, 0).param.startswith("mtp.")]
        if not any(not _SKIP.match(k) for k in mtp):
            if len(model.mtp):
                log.info("the checkpoint has no MTP tensors: its MTP layers are not loaded")
            model.mtp = torch.nn.ModuleList()
        loader = _Loader(model, keys)
        total = sum(os.path.getsize(f) for f in files)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < 2**30
        ) as bar:
            for h in handles:  # shard by shard: each file's pages are read once, in order
                for key in h.keys():
                    bar.update(loader.load(key))
    if cfg.tie_word_embeddings and "head.weight" not in loader.filled:
        if "embed.weight" in loader.filled:
            with torch.no_grad():
                model.head.weight.copy_(model.embed.weight)
            loader.filled.add("head.weight")
    missing = [
        s
        for k in loader.state
        for s in _expected_sources(k, cfg.num_experts)
        if s not in loader.filled
    ]
    if missing or any(loader.problems.values()):
        raise WeightsError(_report(model_dir, {"missing": missing, **loader.problems}))
    for module in model.modules():
        if isinstance(module, Fp4Experts):
            module.note_scales()


class _Loader:
    """Copies checkpoint tensors into a model's parameters, one weight (and its scale) a call."""

    def __init__(self, model: DeepseekV4, keys: dict) -> None:
        self.inter, self.tp = model.cfg.moe_intermediate_size, model.tp
        state = dict(model.named_parameters()) | dict(model.named_buffers())
        self.state = {k: v for k, v in state.items() if not k.startswith("rope_tables.")}
        self.keys = keys  # checkpoint name -> the open file holding it
        self.mtp = len(model.mtp) > 0  # (config.json may turn the checkpoint's MTP layers off)
        self.scale_of = {
            key.removesuffix(suffix) + ".weight": key
            for key in keys
            for suffix in _SCALE_SUFFIXES
            if key.endswith(suffix) and key.removesuffix(suffix) + ".weight" in keys
        }
        self.scales = set(self.scale_of.values())
        self.filled: set[str] = set()  # checkpoint names (release naming) copied into the model
        self.problems: dict[str, list[str]] = {
            "unexpected": [],
            "wrong shape": [],
            "wrong format": [],
        }

    def load(self, key: str) -> int:
        """Load checkpoint tensor `key` (a scale loads with its weight); returns bytes read."""
        if key in self.scales or _SKIP.match(key):
            return 0
        target = canonical_target(key, self.inter)
        if not self.mtp and target.param.startswith("mtp."):
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
            scale = _as_e8m0(self.keys[scale_key].get_tensor(scale_key))
            read = tensor.numel() * tensor.element_size() + scale.numel()
            try:
                tensor = self._part(_dequantize(tensor, scale), dim)
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
        self, key: str, scale_key: str | None, target: _Target, dest: torch.Tensor, dim: int | None
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
        scale_target = target.scale()
        scale_dest = self.state[scale_target.param]
        scale_dest = scale_dest[scale_target.index] if scale_target.index else scale_dest
        self.filled.add(scale_target.source)
        if not (
            self._shape_ok(key, self._shape(key), dest, dim)
            and self._shape_ok(scale_key, self._shape(scale_key), scale_dest, dim)
        ):
            return 0
        scale = _as_e8m0(self._read(scale_key, dim))
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


def _as_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales, also when stored as their raw bytes (U8)."""
    return scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of an FP8 block-scaled or FP4 (int8 pairs) weight."""
    if codes.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_blocks(codes, scale)
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
