"""Tiny random DeepSeek-V3.2 checkpoints (`dsaserve make-tiny-model DIR --model-type
deepseek_v32`): the whole architecture in a few MB, made in seconds.

Random but deterministic weights (a fixed seed) under HF's names (what DeepSeek publishes and
save_pretrained writes), with the byte-level tokenizer in the release's variant: no chat template,
as the V3.2 release ships none (its prompts come from engine.text.chat.encoding_dsv32). The text
is noise; they exist to run the whole stack - dense and MoE layers (grouped routing, shared
experts), an indexer with >= 16 heads and an index_topk that real prompts exceed - in tests and
on any machine. Two formats:

- `dense`: fp32 weights in one model.safetensors, a vocabulary exactly the tokenizer's, no MTP
  layer (as save_pretrained writes it).
- `release`: the published checkpoint's layout in miniature (widths that are multiples of its
  128-wide blocks, split evenly over two ranks): `quantization_config` and
  `num_nextn_predict_layers: 1`, FP8 e4m3 linears (attention, the indexer's wq_b and wk, dense
  MLPs, routed and shared experts) with fp32 power-of-two `weight_scale_inv` per 128 x 128
  block, bf16 norms, router, embeddings, head, weights_proj and MTP projection, an fp32
  e_score_correction_bias, the MTP layer as `model.layers.{num_layers}.*` with its copies of the
  embedding and head, two shards behind model.safetensors.index.json, and a vocabulary larger
  than its tokenizer (the head's extra rows scaled up, so an engine that forgot to mask them
  would sample them nearly every step).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.weights import build_model
from dsaserve.engine.models.tiny_weights import (
    PAD_HEAD_GAIN,
    first_half_of_layers,
    quantize_fp8,
    random_value,
    save_shards,
    split_experts,
)
from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer

FORMATS = ("dense", "release")
RELEASE_VOCAB = 384  # model rows; the tokenizer has 264 tokens

# Ours (the release's names) -> HF's, applied in order (the inverse of weights.py's renames).
_HF_NAMES = [
    (re.compile(r"^embed\."), "model.embed_tokens."),
    (re.compile(r"^head\."), "lm_head."),
    (re.compile(r"^norm\."), "model.norm."),
    (re.compile(r"\.attn_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
    (re.compile(r"\.attn\.wq_a\."), ".attn.q_a_proj."),
    (re.compile(r"\.attn\.q_norm\."), ".attn.q_a_layernorm."),
    (re.compile(r"\.attn\.wq_b\."), ".attn.q_b_proj."),
    (re.compile(r"\.attn\.wkv_a\."), ".attn.kv_a_proj_with_mqa."),
    (re.compile(r"\.attn\.kv_norm\."), ".attn.kv_a_layernorm."),
    (re.compile(r"\.attn\.wkv_b$"), ".attn.kv_b_proj.weight"),
    (re.compile(r"\.attn\.wo\."), ".attn.o_proj."),
    (re.compile(r"\.attn\."), ".self_attn."),
    (re.compile(r"\.ffn\.gate\.bias$"), ".ffn.gate.e_score_correction_bias"),
    (re.compile(r"\.w1\.weight$"), ".gate_proj.weight"),
    (re.compile(r"\.w3\.weight$"), ".up_proj.weight"),
    (re.compile(r"\.w2\.weight$"), ".down_proj.weight"),
    (re.compile(r"\.ffn\."), ".mlp."),
    (re.compile(r"^(mtp\.\d+)\.norm\."), r"\1.shared_head.norm."),
    (re.compile(r"^layers\."), "model.layers."),
]
_MTP = re.compile(r"^mtp\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Stored FP8 in the published checkpoint: every linear of attention, indexer (but weights_proj)
# and feed-forward; the router, norms, embeddings, head and the MTP projection stay dense.
_FP8_STORED = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b"
    r"|indexer\.wk)|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
_FP32_STORED = re.compile(r"\.e_score_correction_bias$")


def tiny_config(vocab_size: int) -> dict:
    """The dense tiny model's config.json, in HF's field names."""
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "num_nextn_predict_layers": 0,
        **_shared_fields(),
        "dtype": "float32",
    }


def release_tiny_config() -> dict:
    """The release-format tiny model's config.json: what the published one holds, scaled down."""
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": RELEASE_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,  # the dense MLP's FP8 blocks split over two ranks
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 48,  # 2 heads x (48 + 16) = 128 rows of q_b_proj a rank
        "qk_rope_head_dim": 16,
        "v_head_dim": 64,  # 2 heads x 64 = 128 inputs of o_proj a rank
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,  # 256 shared intermediate: 128 a rank
        "num_nextn_predict_layers": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        **_shared_fields(),
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }


def _shared_fields() -> dict:
    """The fields both tiny models write alike; a fresh dict each call."""
    return {
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
    }


def make_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    fmt: str = "dense",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny checkpoint (config, weights, tokenizer) of format `fmt` (FORMATS) into
    out_dir; returns its path. `overrides` replaces config.json fields (a random model of any
    shape: bench/engine.py writes a V3.2-width slice)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    release = fmt == "release"
    tokens = write_byte_tokenizer(out, release=True)
    raw = (release_tiny_config() if release else tiny_config(tokens)) | (overrides or {})
    cfg = ModelConfig.from_hf(raw)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    ours = {name: random_value(name, t, gen) for name, t in model.state_dict().items()}
    for name in ours:
        if name.endswith("gate.bias"):  # a selection bias of the size DeepSeek's are
            ours[name] *= 0.2
    tensors = {
        _hf_name(name, cfg.num_layers): t
        for name, t in split_experts(ours, cfg.moe_intermediate_size).items()
    }
    for i in range(len(model.mtp)):  # the MTP layer's copies of the shared embedding and head
        prefix = f"model.layers.{cfg.num_layers + i}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"]
    if release:
        tensors["lm_head.weight"][tokens:] *= PAD_HEAD_GAIN
        in_first = first_half_of_layers(cfg.num_layers, _LAYER, "model.embed_tokens.")
        save_shards(_release_formats(tensors), out, in_first)
    else:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _hf_name(name: str, num_layers: int) -> str:
    """Our parameter name -> HF's (the MTP layers after the others)."""
    m = _MTP.match(name)
    for pattern, repl in _HF_NAMES:
        name = pattern.sub(repl, name)
    if m:
        name = f"model.layers.{num_layers + int(m.group(1))}." + name[m.end() :]
    return name


def _release_formats(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 tensors -> the published storage formats (FP8 ones with `<name>.weight_scale_inv`)."""
    out = {}
    for name, t in tensors.items():
        if _FP8_STORED.search(name):
            scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
            out[name], out[scale_name] = quantize_fp8(t, scale_as_fp32=True)
        elif _FP32_STORED.search(name):
            out[name] = t
        else:
            out[name] = t.to(torch.bfloat16)
    return out
