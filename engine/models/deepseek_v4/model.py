"""DeepSeek-V4 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

Parameter names follow DeepSeek's release (`layers.N.attn.wq_a.weight`, ...); weights.py
maps HF `save_pretrained` names onto them. The multi-token-prediction layers (`mtp.N.*`) are
built and loaded but not run by `forward` (speculative decoding will).

Under tensor parallelism (`tp`) every rank builds its shard: the vocabulary-parallel embedding
and head (engine.layers.parallel), attention split by heads, MoE split by experts (their
modules say how); the mHC parameters, norms and routers are replicated.
"""

from __future__ import annotations

from typing import cast

import torch

from engine.kv.pool import KVPool
from engine.layers.norm import RMSNorm
from engine.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from engine.layers.rope import RotaryTable
from engine.models.deepseek_v4.block import Block
from engine.models.deepseek_v4.config import ModelConfig, Quantization
from engine.models.deepseek_v4.mhc import HyperHead
from engine.models.deepseek_v4.mtp import MTPLayer
from engine.parallel.group import SINGLE, TensorParallel
from engine.profiling import profiled
from engine.step import StepInputs, StepState


class DeepseekV4(torch.nn.Module):
    def __init__(
        self, cfg: ModelConfig, quant: Quantization | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        """quant: the checkpoint's formats kept in memory (FP8 linears, FP4 experts) and computed
        as the release does; None: every weight dense, in the default dtype. tp: the group this
        rank's shard belongs to."""
        super().__init__()
        self.cfg, self.quant, self.tp = cfg, quant, tp
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(Block(cfg, i, quant, tp) for i in range(cfg.num_layers))
        self.mtp = torch.nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + i, quant, tp) for i in range(len(cfg.mtp_layer_types))
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.rope_tables = torch.nn.ModuleDict(
            {
                "main": RotaryTable(cfg.rope_main, cfg.rope_dim),
                "compress": RotaryTable(cfg.rope_compress, cfg.rope_dim),
            }
        )

    @torch.inference_mode()
    def forward(self, pool: KVPool, inputs: StepInputs, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(logit_rows), vocab] of the selected rows."""
        step = StepState(
            pool, inputs, {k: cast(RotaryTable, t) for k, t in self.rope_tables.items()}
        )
        with profiled("embed"):
            x = self.embed(inputs.token_ids)
        streams = (
            x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        )  # [N, hc_mult, hidden]
        for layer in self.layers:
            streams = layer(streams, step)
        with profiled("head"):
            hidden = self.norm(self.hc_head(streams[logit_rows]))
            return self.head(hidden)
