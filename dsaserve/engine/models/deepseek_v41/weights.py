"""DeepSeek-V4.1's checkpoint names, and its model built and loaded (engine.models.loading reads
the tensors: formats, scales, shards).

Names: the release's (what the Hub checkpoint holds: `layers.N.attn.wq_a.weight`,
`layers.N.engram.wkv.weight`, `layers.N.ffn.experts.E.w1.weight`, `head.weight`, ...), and the
spellings of HF transformers' `save_pretrained` that DeepSeek-V4's loader reads (a `model.`
prefix, `embed_tokens`, `lm_head`, `hc_attn_fn` / `hc_attn.fn`, `attn.norm`; one rename table
with V4's). FP8 weights come in 32 x 32 blocks (`wo_a` also in 128 x 128: it is dequantized at
load either way, as the release's convert.py does), FP4 experts with a scale per 32.

Not read: the vision tower and its aligner (`vision.*`, `aligner.*`, `image_start/end/newline`)
and the image tokens' routing bias (`ffn.gate.bias_vl`), since images are not served; the DSpark
draft head (`mtp.*`), which nothing here runs yet. The Engram tables (`layers.N.engram.embed.*`)
are not copied either: they are memory-mapped where they lie (engine.models.deepseek_v41
.engram_table), and the hash's token map is built from the checkpoint's tokenizer, whose
normalized vocabulary must have the config's size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer as BackendTokenizer

from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.models.deepseek_v4.weights import canonical_target
from dsaserve.engine.models.deepseek_v41.config import FP8_BLOCK, ModelConfig
from dsaserve.engine.models.deepseek_v41.engram import compressed_token_map
from dsaserve.engine.models.deepseek_v41.engram_table import (
    DEVICE_CACHE_BYTES,
    EngramTable,
    cache_slots,
    open_table,
)
from dsaserve.engine.models.deepseek_v41.model import DeepseekV41
from dsaserve.engine.models.loading import WeightsError, build, load_checkpoint
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.text.tokenizer import Tokenizer

_NOT_SERVED = re.compile(
    r"^(model\.)?((vision|aligner|mtp)\.|image_(start|end|newline)$)"
    r"|\.ffn\.gate\.bias_vl$|\.engram\.embed\."
)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantized: bool = False,
    tp: TensorParallel = SINGLE,
) -> DeepseekV41:
    """The model in its run-time dtypes on `device`, weights empty until loaded (quantized:
    FP8/FP4 weights kept and computed as the release does; else every weight dense)."""
    if quantized and torch.device(device).type == "cuda":
        raise ConfigError(
            "DeepSeek-V4.1 keeps its FP8 weights in 32 x 32 blocks and quantizes activations per "
            "32 values (experts too); the GPU kernels here take the 128-blocks of V4 and V3.2 "
            "only, so a GPU cannot compute it quantized yet: serve it with "
            "--no-quantized-compute (weights dequantized at load)"
        )
    return build(DeepseekV41, cfg, dtype, device, quantized, tp)


def load_weights(model: DeepseekV41, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, attach its Engram
    tables and token map, or raise WeightsError / ConfigError."""
    cfg = model.cfg
    load_checkpoint(
        model,
        model_dir,
        target=lambda name: canonical_target(name, cfg.moe_intermediate_size),
        skip=lambda name: _NOT_SERVED.search(name) is not None,
        num_experts=cfg.num_experts,
        tie_word_embeddings=cfg.tie_word_embeddings,
        fp8_block=FP8_BLOCK,
    )
    for module in model.modules():
        if isinstance(module, Fp4Experts):
            module.note_scales()
    if cfg.engram is not None:
        _attach_engram(model, str(model_dir))


def _attach_engram(model: DeepseekV41, model_dir: str) -> None:
    engram = model.cfg.engram
    assert engram is not None
    tables = []
    for layer in engram.layer_ids:
        prefix = f"layers.{layer}.engram.embed"
        table = open_table(model_dir, prefix) or open_table(model_dir, f"model.{prefix}")
        if table is None:
            raise WeightsError(f"checkpoint in {model_dir} has no Engram table {prefix}.weight")
        tables.append(table)
    backend = BackendTokenizer.from_str(Tokenizer.from_pretrained(model_dir).backend_json())
    attach_engram(model, tables, compressed_token_map(backend))


def attach_engram(
    model: DeepseekV41,
    tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lookup: list[int],
    cache_bytes: int | None = None,
) -> None:
    """Give each Engram layer its table, in host memory behind a device cache of `cache_bytes`
    (None: DEVICE_CACHE_BYTES of the model's device type; 0: none), and the hasher its token
    map; raise WeightsError / ConfigError where they disagree with the config.

    tables: per Engram layer, host tensors codes [rows, head_dim] and scales [rows,
    head_dim / 32], uint8 (e4m3 bits, ue8m0); lookup: the tokenizer's compressed map
    (compressed_token_map). The loader passes the checkpoint's; bench.v41_slice synthetic ones."""
    engram = model.cfg.engram
    assert engram is not None and model.hasher is not None
    param = next(model.parameters())
    device, dtype = param.device, model.embed.weight.dtype
    budget = DEVICE_CACHE_BYTES.get(device.type, 0) if cache_bytes is None else cache_bytes
    for layer, rows, module, (codes, scales) in zip(
        engram.layer_ids, engram.num_embeddings, model.engrams(), tables, strict=True
    ):
        want = [(rows, engram.head_dim), (rows, engram.head_dim // 32)]
        if [tuple(codes.shape), tuple(scales.shape)] != want:
            raise WeightsError(
                f"layers.{layer}.engram.embed: checkpoint {list(codes.shape)} / "
                f"{list(scales.shape)}, the config says {want[0]} FP8 values with {want[1]} scales"
            )
        slots = cache_slots(rows, engram.head_dim * dtype.itemsize, budget)
        module.table = EngramTable(codes, scales, device, dtype, slots)
    size = max(lookup) + 1
    if size != engram.compressed_vocab_size:
        raise ConfigError(
            f"config.json field `engram_compressed_vocab_size` is {engram.compressed_vocab_size}, "
            f"but the checkpoint's tokenizer normalizes to {size} ids: every Engram hash derives "
            "from that size, so the tables would be read at the wrong rows"
        )
    model.hasher.set_token_map(lookup)
