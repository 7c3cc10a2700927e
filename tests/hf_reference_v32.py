"""HF transformers' DeepseekV32ForCausalLM as the numerical reference (test-only dependency).

Random checkpoints as a user gets them (`save_pretrained`, HF names), with weights scaled so that
activations stay O(1) and greedy choices have real margins; and the HF model of a tiny
release-format checkpoint (engine.models.deepseek_v32.tiny), its FP8 weights dequantized
(`weight * weight_scale_inv` per 128 x 128 block), which is what the engine computes in fp32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer
from dsaserve.kernels.quant import expand_blocks

VOCAB = 264  # the byte tokenizer's vocabulary (release variant: V3.2 ships no template)

BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=8,
    max_position_embeddings=2048,
    bos_token_id=256,
    eos_token_id=257,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def make_hf_checkpoint(
    path: str | os.PathLike, seed: int = 0, **overrides
) -> DeepseekV32ForCausalLM:
    """A random DeepseekV32ForCausalLM saved with save_pretrained (fp32) into `path`."""
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**{**BASE_CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    write_byte_tokenizer(path, release=True)
    return model


def dequantized_hf_model(release_dir: str | os.PathLike, out: Path) -> DeepseekV32ForCausalLM:
    """HF's model of a release-format checkpoint: its FP8 weights dequantized, the MTP layer
    (which HF does not build) left out, saved in fp32 into `out` and loaded from there."""
    raw = json.loads((Path(release_dir) / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    index = json.loads((Path(release_dir) / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(Path(release_dir) / file, framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}
        for name, t in stored.items():
            parts = name.split(".")
            if name.endswith(".weight_scale_inv") or (
                name.startswith("model.layers.") and int(parts[2]) >= layers
            ):
                continue
            scale = stored.get(name.removesuffix(".weight") + ".weight_scale_inv")
            if scale is not None:
                t = t.float() * expand_blocks(scale.float(), *t.shape, 128)
            tensors[name] = t.float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in raw.items() if k not in ("quantization_config", "torch_dtype")}
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return DeepseekV32ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
