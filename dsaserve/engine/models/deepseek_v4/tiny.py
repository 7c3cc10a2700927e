"""Tiny random DeepSeek-V4 checkpoints (`dsaserve make-tiny-model`): every layer type, in a few
MB, made in seconds.

Random but deterministic weights (a fixed seed) under DeepSeek's release names (which HF
transformers' loader also accepts), with the byte-level tokenizer. The text is noise; they
exist to run the whole stack - sliding, CSA (with >= 16 indexer heads and an index_topk that
real prompts exceed) and HCA layers, hash-routed and routed MoE - in tests and on any machine.
The built-in model users meet is the trained one (engine/demo_model.py). Two formats:

- `dense`: fp32 weights in one model.safetensors, a vocabulary exactly the tokenizer's.
- `release`: the DeepSeek-V4-Flash release's layout in miniature (widths that are multiples of
  its 128-wide blocks, HCA at its real rate 128): the config.json keys of the release
  (`compress_ratios` with the MTP layer's entry, `quantization_config`, top-level
  `expert_dtype`), FP8 e4m3 linears with ue8m0 128x128 block scales (`<name>.scale`, `wo_a`
  included), FP4 routed experts (e2m1 pairs in int8, ue8m0 per 32), bf16 norms, router, head,
  embeddings and compressor projections, fp32 mHC parameters, sinks and slot biases, an int64
  hash table, one MTP layer (`mtp.0.*`), two shards behind model.safetensors.index.json, and
  a vocabulary larger than its tokenizer. The head's rows past the tokenizer are scaled up so
  that an engine which forgot to mask them would sample them nearly every step.

`draft="dspark"` gives either format a DSpark head instead of an MTP layer, in the release's
layout (V4-Flash-0731's): the `dspark_*` config fields, three sliding-window draft layers under
`mtp.{0,1,2}`, `mtp.0.main_proj` (FP8 in the release format) and `main_norm`, the head stack
(`norm`, `hc_head_*`, `markov_head.*`, `confidence_head.*`) under the last one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.weights import build_model
from dsaserve.engine.models.tiny_weights import (
    PAD_HEAD_GAIN,
    first_half_of_layers,
    quantize_fp8,
    random_value,
    save_shards,
    split_experts,
)
from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.kernels.quant import quantize_fp4

FORMATS = ("dense", "release")
RELEASE_VOCAB = 384  # model rows; the release-format tokenizer has 264 tokens

# Stored FP8 in the release (the table in shared/reference/v4-release.md), wo_a included.
_FP8_STORED = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
    r"|e_proj|h_proj|main_proj)\.weight$"
)
_FP4_STORED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
# Stored fp32: mHC parameters, sinks, compressor slot biases, router biases.
_FP32_STORED = re.compile(
    r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|\.gate\.bias|confidence_head\.proj\.weight)$"
)
DRAFTS = ("mtp", "dspark")  # draft heads a tiny checkpoint can carry (mtp: the format's own)
DSPARK_LAYERS = 3  # V4-Flash-0731's


def _shared_fields() -> dict:
    """The fields both tiny models write alike (mHC, indexer, norms, RoPE, routing scores); a
    fresh dict each call, so a caller may edit its config's nested ones."""
    return {
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }


def tiny_config(vocab_size: int) -> dict:
    """The dense tiny model's config.json."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 16,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "swiglu_limit": 10.0,
        **_shared_fields(),
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "dtype": "float32",
    }


def release_tiny_config() -> dict:
    """The release-format tiny model's config.json, in the release's own field names."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": RELEASE_VOCAB,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 128,  # wo_b splits over two ranks on its 128-wide FP8 blocks
        "sliding_window": 16,
        "compress_ratios": [0, 4, 128, 4, 128, 4, 0],  # six layers, then the MTP layer
        "num_hash_layers": 2,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        **_shared_fields(),
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }


def dspark_fields(raw: dict, tokens: int) -> dict:
    """The config.json fields of a DSpark head on the model `raw` describes (V4-Flash-0731's,
    in miniature): blocks of 5, the last three layers tapped, the tokenizer's last id as the
    noise token, no MTP layer (the release's trailing compress_ratios entries are the draft
    layers', all 0)."""
    n = raw["num_hidden_layers"]
    fields = {
        "dspark_block_size": 5,
        "dspark_markov_rank": 16,
        "dspark_noise_token_id": tokens - 1,
        "dspark_target_layer_ids": list(range(n - 3, n)),
        "num_nextn_predict_layers": 1,  # (as 0731's config says; the head is read from dspark_*)
    }
    if "compress_ratios" in raw:
        fields["compress_ratios"] = raw["compress_ratios"][:n] + [0] * DSPARK_LAYERS
    return fields


def make_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    fmt: str = "dense",
    overrides: dict[str, Any] | None = None,
    draft: str = "mtp",
) -> Path:
    """Write a tiny checkpoint (config, weights, tokenizer) of format `fmt` (FORMATS) into
    out_dir; returns its path. `overrides` replaces config.json fields (a random model of any
    shape: bench/disagg.py writes a V4-Flash-width slice); draft "dspark": a DSpark head
    instead of the format's MTP layer."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    release = fmt == "release"
    tokens = write_byte_tokenizer(out, release=release)
    raw = release_tiny_config() if release else tiny_config(tokens)
    if draft == "dspark":
        raw |= dspark_fields(raw, tokens)
    raw |= overrides or {}
    cfg = ModelConfig.from_hf(raw)
    if cfg.dspark is not None:  # (the model builds the head only to draft with it)
        cfg = dataclasses.replace(cfg, draft_layers=cfg.dspark.num_layers)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: _init(name, t, gen, raw)
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
        if not name.startswith("rope_tables.")
    }
    if release:
        tensors["head.weight"][tokens:] *= PAD_HEAD_GAIN
        save_release(tensors, raw, out)
    else:
        save_file(release_names(tensors, raw), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def release_names(tensors: dict[str, torch.Tensor], raw: dict) -> dict[str, torch.Tensor]:
    """Our parameter names -> the release's, stacked experts split per expert."""
    draft = [int(n.split(".")[2]) for n in tensors if n.startswith("dspark.layers.")]
    named = {release_name(name, 1 + max(draft, default=-1)): t for name, t in tensors.items()}
    return split_experts(named, raw["moe_intermediate_size"])


def save_release(tensors: dict[str, torch.Tensor], raw: dict, out: Path) -> None:
    """A model's fp32 tensors under our parameter names (rope tables left out) -> the
    release's checkpoint in `out`: its names and storage formats (FP8 linears, FP4 experts,
    bf16 / fp32 / int64 the rest), two shards and their index. `raw` is the config.json it is
    written with (the caller writes that)."""
    in_first = first_half_of_layers(
        raw["num_hidden_layers"], re.compile(r"layers\.(\d+)\."), "embed."
    )
    save_shards(_release_formats(release_names(tensors, raw)), out, in_first)


def _init(name: str, t: torch.Tensor, gen: torch.Generator, raw: dict) -> torch.Tensor:
    if name.endswith("tid2eid"):  # distinct experts per token, as a hash router assigns them
        vocab, k = t.shape
        draws = torch.rand(vocab, raw["n_routed_experts"], generator=gen)
        return draws.argsort(dim=1)[:, :k].contiguous()
    return random_value(name, t, gen)


def release_name(name: str, dspark_layers: int = 0) -> str:
    """Our parameter name -> DeepSeek's release name (the inverse of weights.py's renames; a
    DSpark head of `dspark_layers` layers under mtp.*, as models.deepseek_v4.dspark lists; V4.1
    names its tensors alike)."""
    if name.startswith("dspark.layers."):
        name = "mtp." + name.removeprefix("dspark.layers.")
    elif name.startswith("dspark.main_"):
        name = "mtp.0." + name.removeprefix("dspark.")
    elif name.startswith("dspark."):
        name = f"mtp.{dspark_layers - 1}." + name.removeprefix("dspark.")
    for ours, theirs in (
        (".hc_attn.", ".hc_attn_"),
        (".hc_ffn.", ".hc_ffn_"),
        ("hc_head.", "hc_head_"),
    ):
        name = name.replace(ours, theirs)
    return name + ".weight" if name.endswith(".attn.wo_a") else name


def _release_formats(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 tensors -> the release's storage formats (quantized ones with `<name>.scale`)."""
    out = {}
    for name, t in tensors.items():
        if _FP4_STORED.search(name):
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp4(t)
        elif _FP8_STORED.search(name):
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp8(t, False)
        elif t.dtype == torch.int64 or _FP32_STORED.search(name):
            out[name] = t
        else:
            out[name] = t.to(torch.bfloat16)
    return out
