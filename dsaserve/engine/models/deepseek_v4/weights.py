"""DeepSeek-V4's checkpoint names, and its model built and loaded (engine.models.loading reads
the tensors: formats, scales, shards).

Names: DeepSeek's release names (`layers.N.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`,
`layers.N.ffn.experts.E.w1.weight`, `mtp.0.e_proj.weight`, ...) and what HF transformers'
`save_pretrained` writes (the same with a `model.` prefix, `embed_tokens`, `hc_head.hc_fn`,
`attn.norm` for the release's `attn.kv_norm`). `wo_a` is always dequantized (as the release's
convert.py does) and FP8 routed experts too (no FP8 expert kernel here); the rest of an FP8/FP4
checkpoint stays quantized when the model keeps it so.

The MTP layers (`mtp.N.*`) load when the checkpoint has any of their tensors; HF's
save_pretrained writes none, and a config.json with `num_nextn_predict_layers: 0` skips them. On a
checkpoint that bundles a DSpark head (`dspark_*` fields) the same names are the head's
(models.deepseek_v4.dspark: `mtp.i.<block>` its layer i, the rest at its own level, as vLLM
maps them), loaded only when the model speculates with it.
"""

from __future__ import annotations

import os
import re

import torch

from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.dspark import HEAD_TENSORS
from dsaserve.engine.models.deepseek_v4.model import DeepseekV4
from dsaserve.engine.models.deepseek_v4.moe import Fp4Experts
from dsaserve.engine.models.loading import Target, build, expert_target, load_checkpoint
from dsaserve.engine.parallel.group import SINGLE, TensorParallel

_RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^lm_head\."), "head."),
    (re.compile(r"(^|\.)hc_head\.hc_(fn|base|scale)$"), r"\1hc_head.\2"),
    (re.compile(r"(^|\.)hc_head_(fn|base|scale)$"), r"\1hc_head.\2"),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
    (re.compile(r"\.attn\.norm\."), ".attn.kv_norm."),
    (re.compile(r"\.attn\.wo_a\.weight$"), ".attn.wo_a"),
]
_EXPERT = re.compile(
    r"^((?:layers|mtp|dspark\.layers)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$"
)
_DRAFT = re.compile(r"^mtp\.(\d+)\.(.*)$")
# Copies of the shared embedding and head that some MTP exports carry (convert.py skips them).
_SKIP = re.compile(r"^mtp\.\d+\.(emb[^.]*|head)\.")


def canonical_target(name: str, inter: int, dspark: bool = False) -> Target:
    """Map a checkpoint weight name onto (our parameter, slice); dspark: `mtp.*` is a DSpark
    head."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    m = _DRAFT.match(name) if dspark else None
    if m:
        stage, rest = m.groups()
        name = (
            f"dspark.{rest}" if rest.startswith(HEAD_TENSORS) else f"dspark.layers.{stage}.{rest}"
        )
    m = _EXPERT.match(name)
    if m:
        return expert_target(m.group(1), int(m.group(2)), m.group(3), inter)
    return Target(name, (), name)


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
    return build(DeepseekV4, cfg, dtype, device, quantized, tp)


def load_weights(model: DeepseekV4, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, or raise WeightsError."""
    cfg = model.cfg
    load_checkpoint(
        model,
        model_dir,
        target=lambda name: canonical_target(name, cfg.moe_intermediate_size, bool(cfg.dspark)),
        skip=lambda name: _SKIP.match(name) is not None,
        num_experts=cfg.num_experts,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    for module in model.modules():
        if isinstance(module, Fp4Experts):
            module.note_scales()
