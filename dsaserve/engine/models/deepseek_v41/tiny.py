"""Tiny random DeepSeek-V4.1 checkpoints (`dsaserve make-tiny-model --model-type deepseek_v41`):
every kind of layer, in a few MB, made in seconds.

Eight layers, as DeepSeek-V4.1-Flash's forty in miniature: a sliding layer; two ratio-2 KV
sources (the first read by the layer after it); the ratio-1 KV source, which is the candidate
source; then three layers that keep only their window (the decoder: bounded replay trims them),
one an index source scoring inside the candidates and one reusing its picks. Engram on the
sliding layer and on a source. Small windows, a small top-k and blocks that real prompts
exceed, >= 16 indexer heads. The byte-level tokenizer with V4.1's chat tokens (its normalized
vocabulary sets `engram_compressed_vocab_size`; the model's vocabulary padded past it to a
multiple of 16, as the release's), no chat template (V4.1 chats render through deepseek-recipe).

Two formats:
- `dense`: fp32 weights in one model.safetensors; the Engram tables in their one format (FP8
  rows with a ue8m0 scale per 32 values).
- `release`: the release's layout: config.json with `text_config` nested and the
  `quantization_config` of 32 x 32 FP8 blocks, FP8 e4m3 linears with ue8m0 block scales
  (`<name>.scale`), FP4 routed experts (e2m1 pairs, a scale per 32), bf16 norms, router, head,
  embeddings, compressor and indexer-key projections, fp32 mHC parameters, sinks and router
  biases, two shards behind model.safetensors.index.json, and what the release holds that is
  not served (the image tokens' routing bias, vision tower, aligner, image delimiters, the DSpark
  head's tensors): the loader must skip them, not choke on them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsaserve.engine.models.deepseek_v4.tiny import release_name
from dsaserve.engine.models.deepseek_v41.config import FP8_BLOCK, EngramConfig, ModelConfig
from dsaserve.engine.models.deepseek_v41.engram import bucket_primes
from dsaserve.engine.models.deepseek_v41.weights import build_model
from dsaserve.engine.models.tiny_weights import (
    first_half_of_layers,
    random_value,
    save_shards,
    split_experts,
)
from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.kernels.quant import act_quant_reference, quantize_fp4, quantize_fp8_blocks

FORMATS = ("dense", "release")
# The byte tokenizer's ids once normalized (engram.compressed_token_map: its size is what every
# Engram hash derives from; the loader refuses a config that says otherwise)
COMPRESSED_VOCAB = 236

_FP8_STORED = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
    r"|engram\.wkv)\.weight$"
)
_FP4_STORED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32_STORED = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn_sink|\.gate\.bias)$")


def text_config(vocab_size: int) -> dict[str, Any]:
    """The tiny model's text_config (the Engram table sizes and compressed vocabulary are
    filled in by make_tiny_model)."""
    return {
        "model_type": "deepseek_v41_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_lora_rank": 32,  # wo_b splits over two ranks on its 32-wide FP8 blocks
        "o_groups": 2,
        "hidden_act": "silu",
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0],  # eight layers, then the DSpark head's
        "kv_source_layer_ids": [1, 3, 4],
        "index_source_layer_ids": [1, 3, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "index_topk": 8,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "engram_layer_ids": [0, 3],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 40,
        "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
    }


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """The dense tiny model's config.json with its text_config's fields at the top level (read
    alike: model_dir.language_config), so a test edits one of them as it edits V4's."""
    return {**_sized(text_config(vocab_size)), "model_type": "deepseek_v41"}


def _sized(text: dict[str, Any]) -> dict[str, Any]:
    """text_config with Engram's compressed vocabulary and table sizes: each table exactly its
    buckets, as the release's."""
    text = {"engram_compressed_vocab_size": COMPRESSED_VOCAB} | text
    if text.get("engram_layer_ids"):
        layout = EngramConfig(
            layer_ids=tuple(text["engram_layer_ids"]),
            num_embeddings=(),
            max_ngram_size=text["engram_max_ngram_size"],
            n_heads=text["engram_n_heads"],
            head_dim=text["engram_head_dim"],
            vocab_size=text["engram_vocab_size"],
            compressed_vocab_size=text["engram_compressed_vocab_size"],
            pad_token_id=text["engram_pad_token_id"],
        )
        text["engram_num_embeddings"] = [sum(p) for p in bucket_primes(layout)]
    return text


def make_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    fmt: str = "dense",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny checkpoint of format `fmt` (FORMATS) into out_dir; returns its path.
    `overrides` replaces text_config fields (a random model of any shape: the benches' slices)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens = write_byte_tokenizer(out, v41=True)
    # padded past the tokenizer, as the release's (129,280 rows): ranks split it evenly
    text = _sized(text_config(-(-tokens // 16) * 16) | (overrides or {}))
    raw = _config(text, fmt)
    cfg = ModelConfig.from_hf(raw)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith(("rope_tables.", "hasher.")):
            tensors[release_name(name)] = random_value(name, t, gen)
    tensors = split_experts(tensors, cfg.moe_intermediate_size)
    if cfg.engram is not None:
        for layer, rows in zip(cfg.engram.layer_ids, cfg.engram.num_embeddings, strict=True):
            table = torch.randn(rows, cfg.engram.head_dim, generator=gen)
            codes, scales = act_quant_reference(table, FP8_BLOCK)  # rows of FP8 per 32 values
            tensors[f"layers.{layer}.engram.embed.weight"] = codes
            tensors[f"layers.{layer}.engram.embed.scale"] = scales
    if fmt == "release":
        tensors |= _not_served(cfg, gen)
        in_first = first_half_of_layers(cfg.num_layers, re.compile(r"layers\.(\d+)\."), "embed.")
        save_shards(_release_formats(tensors), out, in_first)
    else:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _config(text: dict[str, Any], fmt: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": 129264,
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 1},
    }
    if fmt == "release":
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        }
    return raw


def _not_served(cfg: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A few tensors of each part of the release that is not served."""
    d = cfg.hidden_size
    out = {
        f"layers.{i}.ffn.gate.bias_vl": torch.randn(cfg.num_experts, generator=gen)
        for i in range(cfg.num_layers)
    }
    out["vision.patch_embed.proj.weight"] = torch.randn(16, 3 * 14 * 14, generator=gen)
    out["aligner.w1.weight"] = torch.randn(d, 16, generator=gen)
    out["mtp.0.attn.wq_a.weight"] = torch.randn(cfg.q_lora_rank, d, generator=gen)
    for name in ("image_start", "image_end", "image_newline"):
        out[name] = torch.randn(d, generator=gen)
    return out


def _release_formats(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 tensors -> the release's storage formats (quantized ones with `<name>.scale`)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".engram.embed.weight") or name.endswith(".engram.embed.scale"):
            out[name] = t  # (already the table's format)
        elif _FP4_STORED.search(name):
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp4(t)
        elif _FP8_STORED.search(name):
            codes, scale = quantize_fp8_blocks(t, FP8_BLOCK)
            out[name], out[name.removesuffix(".weight") + ".scale"] = codes, scale
        elif _FP32_STORED.search(name) or name.endswith("bias_vl"):
            out[name] = t
        else:
            out[name] = t.to(torch.bfloat16)
    return out
