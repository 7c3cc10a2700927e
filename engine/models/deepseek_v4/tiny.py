"""A tiny random DeepSeek-V4 checkpoint (`dsaserve make-tiny-model`): every layer type, in a
few MB, made in seconds.

Random but deterministic weights (a fixed seed), written under DeepSeek's release names
(which HF transformers' loader also accepts), with the byte-level tokenizer. Its text is
noise; it exists to run the whole stack - sliding, CSA (with >= 16 indexer heads and an
index_topk that real prompts exceed) and HCA layers, hash-routed and routed MoE - in tests and
on any machine. The built-in model users meet is the trained one (engine/demo_model.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.byte_tokenizer import write_byte_tokenizer
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.weights import build_model


def tiny_config(vocab_size: int) -> dict:
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
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
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
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "dtype": "float32",
    }


def make_tiny_model(
    out_dir: str | os.PathLike, seed: int = 0, *, release_tokenizer: bool = False
) -> Path:
    """Write the tiny checkpoint (config, weights, tokenizer) into out_dir; returns its path.

    release_tokenizer: the V4 release's tokenizer in miniature (all its markers, no chat
    template), so chats go through `engine.chat.encode_messages` as the release's would."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(out, release=release_tokenizer)
    raw = tiny_config(vocab)
    model = build_model(ModelConfig.from_hf(raw), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rope_tables."):
            continue
        tensors[_release_name(name)] = _init(name, t, gen, raw)
    save_file(
        _split_experts(tensors, raw["moe_intermediate_size"]),
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _init(name: str, t: torch.Tensor, gen: torch.Generator, raw: dict) -> torch.Tensor:
    if name.endswith("tid2eid"):
        return torch.randint(0, raw["n_routed_experts"], t.shape, generator=gen, dtype=torch.int64)
    if name.endswith(("norm.weight", ".scale")):
        return 1 + 0.1 * torch.randn(t.shape, generator=gen)
    if t.dim() == 1:  # sinks, gate biases, mHC biases
        return 0.5 * torch.randn(t.shape, generator=gen)
    fan_in = t.shape[-1]
    return torch.randn(t.shape, generator=gen) * (1.0 if name == "embed.weight" else fan_in**-0.5)


def _release_name(name: str) -> str:
    """Our parameter name -> DeepSeek's release name (the inverse of weights.py's renames)."""
    for ours, theirs in (
        (".hc_attn.", ".hc_attn_"),
        (".hc_ffn.", ".hc_ffn_"),
        ("hc_head.", "hc_head_"),
    ):
        name = name.replace(ours, theirs)
    return name + ".weight" if name.endswith(".attn.wo_a") else name


def _split_experts(tensors: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Stacked expert weights -> per-expert w1/w2/w3, as checkpoints store them."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.w13"):
            prefix = name.removesuffix(".w13")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.w3.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".experts.w2"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('.w2')}.{e}.w2.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out
