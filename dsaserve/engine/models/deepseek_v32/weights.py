"""DeepSeek-V3.2's checkpoint names, and its model built and loaded (engine.models.loading reads
the tensors: formats, scales, shards).

Names, onto the release's (inference/model.py, what its convert.py writes):

    HF (the checkpoint DeepSeek publishes,            ours / the release's
    and what save_pretrained writes)
    model.embed_tokens, lm_head, model.norm            embed, head, norm
    model.layers.N.input_layernorm                     layers.N.attn_norm
    model.layers.N.post_attention_layernorm            layers.N.ffn_norm
    .self_attn.{q_a_proj, q_a_layernorm, q_b_proj}     .attn.{wq_a, q_norm, wq_b}
    .self_attn.{kv_a_proj_with_mqa, kv_a_layernorm}    .attn.{wkv_a, kv_norm}
    .self_attn.{kv_b_proj, o_proj}                     .attn.{wkv_b, wo}
    .self_attn.indexer.{wq_b, wk, k_norm, weights_proj}  .attn.indexer.(same)
    .mlp.{gate_proj, up_proj, down_proj}               .ffn.{w1, w3, w2} (dense, shared, experts.E)
    .mlp.gate.e_score_correction_bias                  .ffn.gate.bias
    model.layers.{num_layers + i}.*                    mtp.i.*  (eh_proj, enorm, hnorm, the block;
                                                       shared_head.norm -> norm)
    <name>.weight_scale_inv (fp32 powers of two)       <name>.scale

The MTP layer's `embed_tokens` and `shared_head.head` are the main model's embedding and head
(DeepSeek shares them); they are not read. The release's convert.py drops the MTP layer, so a
checkpoint in its names loads without one, as does an HF save_pretrained checkpoint.
"""

from __future__ import annotations

import os
import re

import torch

from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.model import DeepseekV32
from dsaserve.engine.models.loading import Target, build, expert_target, load_checkpoint
from dsaserve.engine.parallel.group import SINGLE, TensorParallel

_RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^lm_head\."), "head."),
    (re.compile(r"\.self_attn\."), ".attn."),
    (re.compile(r"\.mlp\."), ".ffn."),
    (re.compile(r"\.input_layernorm\."), ".attn_norm."),
    (re.compile(r"\.post_attention_layernorm\."), ".ffn_norm."),
    (re.compile(r"\.attn\.q_a_proj\."), ".attn.wq_a."),
    (re.compile(r"\.attn\.q_a_layernorm\."), ".attn.q_norm."),
    (re.compile(r"\.attn\.q_b_proj\."), ".attn.wq_b."),
    (re.compile(r"\.attn\.kv_a_proj_with_mqa\."), ".attn.wkv_a."),
    (re.compile(r"\.attn\.kv_a_layernorm\."), ".attn.kv_norm."),
    (re.compile(r"\.attn\.kv_b_proj\."), ".attn.wkv_b."),
    (re.compile(r"\.attn\.o_proj\."), ".attn.wo."),
    (re.compile(r"\.gate_proj\."), ".w1."),
    (re.compile(r"\.up_proj\."), ".w3."),
    (re.compile(r"\.down_proj\."), ".w2."),
    (re.compile(r"\.gate\.e_score_correction_bias$"), ".gate.bias"),
    (re.compile(r"\.shared_head\.norm\."), ".norm."),
    (re.compile(r"\.attn\.wkv_b\.weight$"), ".attn.wkv_b"),  # a plain parameter (absorbed)
]
_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
# The MTP layer's copies of the shared embedding and head.
_SHARED_COPY = re.compile(r"^mtp\.\d+\.(embed_tokens|shared_head\.head)\.")


def canonical_name(name: str, num_layers: int) -> str:
    """A checkpoint name (HF's or the release's) in the release's spelling."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= num_layers:  # HF stores the MTP layers after the others
        name = f"mtp.{int(m.group(1)) - num_layers}." + name[m.end() :]
    return name


def canonical_target(name: str, cfg: ModelConfig) -> Target:
    """Map a checkpoint weight name onto (our parameter, slice)."""
    name = canonical_name(name, cfg.num_layers)
    m = _EXPERT.match(name)
    if m:
        return expert_target(m.group(1), int(m.group(2)), m.group(3), cfg.moe_intermediate_size)
    return Target(name, (), name)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantized: bool = False,
    tp: TensorParallel = SINGLE,
) -> DeepseekV32:
    """Allocate the model directly in its run-time dtypes on `device` (weights empty until loaded).

    quantized: keep an FP8 checkpoint's linear weights as they are and compute as the release
    does; otherwise every weight is dense in `dtype`. Modules create their fp32 parameters (norms,
    the gate's bias, the indexer's key norm) explicitly. tp: this rank's shard is built."""
    return build(DeepseekV32, cfg, dtype, device, quantized, tp)


def load_weights(model: DeepseekV32, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, or raise
    engine.models.loading.WeightsError."""
    cfg = model.cfg
    load_checkpoint(
        model,
        model_dir,
        target=lambda name: canonical_target(name, cfg),
        skip=lambda name: _SHARED_COPY.match(canonical_name(name, cfg.num_layers)) is not None,
        num_experts=cfg.num_experts,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
