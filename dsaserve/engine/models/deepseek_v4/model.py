"""DeepSeek-V4 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

Parameter names follow DeepSeek's release (`layers.N.attn.wq_a.weight`, ...); weights.py
maps HF `save_pretrained` names onto them. The multi-token-prediction layer (`mtp.0.*`) drafts
tokens for speculative decoding (`draft`), fed by the streams `run` keeps.

Under tensor parallelism (`tp`) every rank builds its shard: the vocabulary-parallel embedding
and head (engine.layers.parallel), attention split by heads, MoE split by experts (their
modules say how); the mHC parameters, norms and routers are replicated.
"""

from __future__ import annotations

from typing import cast

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.models.deepseek_v4.block import Block
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.mhc import HyperHead
from dsaserve.engine.models.deepseek_v4.mtp import MTPLayer
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepInputs, StepState


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
        return self.run(pool, inputs, logit_rows)[0]

    @torch.inference_mode()
    def run(
        self, pool: KVPool, inputs: StepInputs, logit_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: (fp32 logits [len(logit_rows), vocab], the last layer's streams
        [N, hc_mult, hidden] of every row: what the MTP layer drafts from)."""
        step = self._step(pool, inputs)
        with profiled("embed"):
            x = self.embed(inputs.token_ids)
        streams = (
            x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        )  # [N, hc_mult, hidden]
        for layer in self.layers:
            streams = layer(streams, step)
        with profiled("head"):
            return self.head(self.norm(self.hc_head(streams[logit_rows]))), streams

    @torch.inference_mode()
    def draft(
        self, pool: KVPool, inputs: StepInputs, streams: torch.Tensor, logit_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over `inputs`: row i at position t holds the token at t + 1 and
        streams [N, hc_mult, hidden] of position t (the main model's last layer, or the MTP
        layer's own for a further draft); returns (fp32 logits [len(logit_rows), vocab]: the
        draft for position t + 2, the MTP layer's streams [N, hc_mult, hidden])."""
        mtp = cast(MTPLayer, self.mtp[0])
        step = self._step(pool, inputs)
        with profiled("draft"):
            e = mtp.e_proj(mtp.enorm(self.embed(inputs.token_ids)))  # [N, hidden]
            x = e.unsqueeze(1) + mtp.h_proj(mtp.hnorm(streams))  # every stream gets it
            out = mtp(x, step)
            return self.head(mtp.norm(mtp.hc_head(out[logit_rows]))), out

    def _step(self, pool: KVPool, inputs: StepInputs) -> StepState:
        return StepState(
            pool, inputs, {k: cast(RotaryTable, t) for k, t in self.rope_tables.items()}
        )
