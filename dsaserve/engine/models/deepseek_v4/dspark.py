"""DeepSeek-V4's DSpark head (V4-Flash-0731, -V4-Flash-DSpark, -V4-Pro-0813): a few full V4
decoder blocks with sliding-window attention that draft a block of gamma tokens in one pass.

Checkpoint tensors (the release's names; vLLM's DSparkDeepseekV4Model reads the same):

    mtp.i.<everything a block has>                   draft layer i (attn.*, ffn.* routed by
                                                     score, hc_attn_*, hc_ffn_*, norms)
    mtp.0.main_proj.{weight,scale}, mtp.0.main_norm  the context projection
    mtp.{n-1}.norm, mtp.{n-1}.hc_head_{fn,base,scale}  the head's mHC collapse and norm
    mtp.{n-1}.markov_head.markov_w{1,2}.weight       [V, r] each (engine.layers.dspark)
    mtp.{n-1}.confidence_head.proj.weight            [1, hidden + r] fp32 (optional)

The embedding and LM head are the target's. How it runs (engine.speculative.dspark_drafter
drives it):

- context: every target step taps the streams after layers `dspark_target_layer_ids` (each
  row's mean over its hc_mult streams), main_x = main_norm(main_proj([tap_1 | ... | tap_L])),
  and each draft layer writes RoPE(kv_norm(wkv(main_x))) as its KV row at the row's position
  (attention.write_context): the draft layers' window rings hold the target's context, position
  for position, in the pools like any layer's state.
- draft: a block of gamma rows at positions p .. p + gamma - 1 (the anchor, the newest token at
  p, then noise tokens) through the draft layers, each row attending to the ring's W rows
  before p and to every row of its block (StepInputs.block); the head's collapse gives h_k, the
  LM head the base logits, engine.layers.dspark the drafts and confidences.
"""

from __future__ import annotations

from typing import cast

import torch

from dsaserve.engine.layers.dspark import ConfidenceHead, MarkovHead
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.models.deepseek_v4.attention import write_context
from dsaserve.engine.models.deepseek_v4.block import Block
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.mhc import HyperHead
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.step import StepState

# what sits at the head's level in the checkpoint, not in a draft layer (under any mtp.i)
HEAD_TENSORS = ("main_proj.", "main_norm.", "norm.", "hc_head.", "markov_head.",
                "confidence_head.")  # fmt: skip


class DSparkHead(torch.nn.Module):
    def __init__(
        self, cfg: ModelConfig, quant: Quantization | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        spec = cfg.dspark
        assert spec is not None
        self.taps, self.hc_mult = spec.target_layer_ids, cfg.hc_mult
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layers = torch.nn.ModuleList(
            Block(cfg, cfg.num_layers + i, quant, tp) for i in range(spec.num_layers)
        )
        self.main_proj = linear(hidden * len(self.taps), hidden, quant is not None)
        self.main_norm = RMSNorm(hidden, eps)
        self.norm = RMSNorm(hidden, eps)
        self.hc_head = HyperHead(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, spec.markov_rank)
        self.confidence_head: ConfidenceHead | None = ConfidenceHead(hidden, spec.markov_rank)

    def tap(self, layer: int, streams: torch.Tensor) -> torch.Tensor | None:
        """What the head reads of the target's streams [N, hc_mult, hidden] after `layer`: their
        mean [N, hidden], or None for a layer it does not read."""
        return streams.mean(dim=1) if layer in self.taps else None

    def write_context(self, taps: list[torch.Tensor], step: StepState) -> None:
        """The step's rows as every draft layer's context (taps: [N, hidden] each, in order)."""
        main_x = self.main_norm(self.main_proj(torch.cat(taps, dim=-1)))  # [N, hidden]
        for layer in self.layers:
            write_context(cast(Block, layer).attn, main_x, step)

    def forward(self, x: torch.Tensor, step: StepState) -> torch.Tensor:
        """Block rows' embeddings x [N, hidden] -> their head hidden states h [N, hidden] (before
        the final norm: the confidence head reads them so)."""
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, step)
        return self.hc_head(streams)
