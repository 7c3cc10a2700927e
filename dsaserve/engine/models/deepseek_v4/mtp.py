"""DeepSeek-V4's multi-token-prediction (MTP) layer: a full decoder block that drafts the token
after next (speculative decoding runs it: DeepseekV4.draft).

Built like the release's `MTPBlock` (inference/model.py), whose checkpoint tensors are, for MTP
layer i (model layer num_layers + i):

    mtp.i.e_proj.{weight,scale}, mtp.i.h_proj.{weight,scale}   FP8 [hidden, hidden]
    mtp.i.enorm.weight, mtp.i.hnorm.weight, mtp.i.norm.weight   norms [hidden]
    mtp.i.hc_head_{fn,base,scale}                                its own mHC head collapse
    mtp.i.<everything a block has>                              attn.*, ffn.* (routed by score,
                                                                 never hashed), hc_attn_*, ...

The embedding and the LM head are the main model's (the V4-Flash checkpoint stores none under
mtp.*). The release's forward, for streams h [N, hc_mult, hidden] of the main model's last
layer at position t and the embedding e of token t+1:

    x = e_proj(enorm(e))[:, None] + h_proj(hnorm(h))     # every stream gets the embedding
    x = block(x)                                         # attention at position t (vLLM's
                                                         # and the training's positions)
    logits = head(norm(hc_head(x)))                      # the draft for token t+2

Its attention keeps KV state like a layer's (layer num_layers + i in the pools) when speculative
decoding is on (ModelConfig.draft_layers).
"""

from __future__ import annotations

from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.models.deepseek_v4.block import Block
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.mhc import HyperHead
from dsaserve.engine.parallel.group import SINGLE, TensorParallel


class MTPLayer(Block):
    """A Block (same parameter names, so `mtp.i.attn.wq_a.weight` loads like a layer's) plus
    the projections and norms that feed it the next token's embedding."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(cfg, layer, quant, tp)  # split like a layer; e_proj, h_proj replicated
        fp8 = quant is not None
        self.e_proj = linear(cfg.hidden_size, cfg.hidden_size, fp8)
        self.h_proj = linear(cfg.hidden_size, cfg.hidden_size, fp8)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)
