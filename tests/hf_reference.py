"""HF transformers' DeepseekV4ForCausalLM as the numerical reference (test-only dependency); the
logits and greedy loops serve any HF causal LM (tests/hf_reference_v32.py: DeepSeek-V3.2).

Builds small random checkpoints the way a user would get them (`save_pretrained`), with
weights scaled so activations stay O(1) and greedy choices have real margins, plus the
tiny tokenizer so `engine.LLM` can load the same directory.
"""

from __future__ import annotations

import os

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedModel

from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer

VOCAB = 262  # the tiny tokenizer's vocabulary

BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=8,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    num_hash_layers=2,
    max_position_embeddings=2048,
    bos_token_id=256,
    eos_token_id=257,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def make_hf_checkpoint(
    path: str | os.PathLike, seed: int = 0, **overrides
) -> DeepseekV4ForCausalLM:
    """A random DeepseekV4ForCausalLM saved with save_pretrained (fp32) into `path`."""
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**BASE_CONFIG, **overrides})
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
            elif name.endswith(("layernorm.weight", "norm.weight", "scale")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(
                    torch.stack(
                        [
                            torch.randperm(cfg.n_routed_experts)[: table.shape[1]]
                            for _ in range(table.shape[0])
                        ]
                    )
                )
            else:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(
    model: PreTrainedModel, prompt: list[int], n: int, vocab: int | None = None
) -> list[int]:
    """n greedy tokens through HF's own cache (its compressor, indexer and window caches),
    among the first `vocab` ids (the tokenizer's, when the embedding is padded past it).

    A plain loop rather than `generate`, whose padding heuristics would mask prompt tokens
    equal to the pad id."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1, :vocab].argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        out = model(
            torch.tensor([[tokens[-1]]]),
            cache=out.cache,
            use_cache=True,
            position_ids=torch.tensor([[pos]]),
        )
        tokens.append(int(out.logits[0, -1, :vocab].argmax()))
    return tokens
