"""One DeepSeek-V4 decoder block: attention and MoE, each between mHC stream mixes."""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.models.deepseek_v4.attention import Attention
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.mhc import HyperConnection
from dsaserve.engine.models.deepseek_v4.moe import MoE
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepState


class Block(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        self.attn = Attention(cfg, layer, quant, tp)
        self.ffn = MoE(cfg, layer, quant, tp)

    def forward(self, streams: torch.Tensor, step: StepState) -> torch.Tensor:
        """streams [N, hc_mult, hidden] -> same shape."""
        with profiled("mhc"):
            streams, post, comb, x = self.hc_attn.pre(streams, self.attn_norm.weight)
        out = self.attn(x, step)
        with profiled("mhc"):
            # The attention's write-back and the MoE's mix in one fused call.
            streams, post, comb, x = self.hc_ffn.pre(
                streams, self.ffn_norm.weight, merge=(out, post, comb)
            )
        with profiled("moe"):
            out = self.ffn(x, step.inp.token_ids)
        with profiled("mhc"):
            return kernels.hc_merge(streams, out, post, comb)
