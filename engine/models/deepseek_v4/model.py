"""DeepSeek-V4 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

Parameter names follow DeepSeek's release (`layers.N.attn.wq_a.weight`, ...); weights.py
maps HF `save_pretrained` names onto them.
"""

from __future__ import annotations

import torch

from engine.kv_pool import KVPool
from engine.layers.norm import RMSNorm
from engine.layers.rope import RotaryTable
from engine.models.deepseek_v4.attention import Attention
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.mhc import HyperConnection, HyperHead, merge_streams
from engine.models.deepseek_v4.moe import MoE
from engine.profiling import profiled
from engine.step import StepInputs, StepState


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, layer)

    def forward(self, streams: torch.Tensor, step: StepState) -> torch.Tensor:
        """streams [N, hc_mult, hidden] -> same shape."""
        with profiled("mhc"):
            post, comb, x = self.hc_attn(streams)
        out = self.attn(self.attn_norm(x), step)
        with profiled("mhc"):
            streams = merge_streams(streams, out, post, comb)
            post, comb, x = self.hc_ffn(streams)
        with profiled("moe"):
            out = self.ffn(self.ffn_norm(x), step.inp.token_ids)
        with profiled("mhc"):
            return merge_streams(streams, out, post, comb)


class DeepseekV4(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_tables = torch.nn.ModuleDict(
            {
                "main": RotaryTable(cfg.rope_main, cfg.rope_dim),
                "compress": RotaryTable(cfg.rope_compress, cfg.rope_dim),
            }
        )

    @torch.inference_mode()
    def forward(self, pool: KVPool, inputs: StepInputs, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(logit_rows), vocab] of the selected rows."""
        step = StepState(pool, inputs, dict(self.rope_tables))
        x = self.embed(inputs.token_ids)
        streams = (
            x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        )  # [N, hc_mult, hidden]
        for layer in self.layers:
            streams = layer(streams, step)
        with profiled("head"):
            hidden = self.norm(self.hc_head(streams[logit_rows]))
            return self.head(hidden).float()
