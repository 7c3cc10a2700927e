"""DeepSeek-V4 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

Parameter names follow DeepSeek's release (`layers.N.attn.wq_a.weight`, ...); weights.py
maps HF `save_pretrained` names onto them. The draft head of speculative decoding is the
multi-token-prediction layer (`mtp.0.*`: `draft`, fed by the streams `run` keeps), or on a
checkpoint that bundles one and when speculating with it, the DSpark head (`dspark`: every step
writes its context, `draft_block` drafts).

Under tensor parallelism (`tp`) every rank builds its shard: the vocabulary-parallel embedding
and head (engine.layers.parallel), attention split by heads, MoE split by experts (their
modules say how); the mHC parameters, norms and routers are replicated.
"""

from __future__ import annotations

from typing import cast

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.dspark import draft_block
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.models.deepseek_v4.block import Block
from dsaserve.engine.models.deepseek_v4.config import ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v4.dspark import DSparkHead
from dsaserve.engine.models.deepseek_v4.mhc import HyperHead
from dsaserve.engine.models.deepseek_v4.mtp import MTPLayer
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepInputs, StepState


class DeepseekV4(torch.nn.Module):
    cuda_graphs = True
    # draft heads the loader drops when the checkpoint stores none of their tensors
    optional_modules: tuple[str, ...] = ("mtp", "dspark", "dspark.confidence_head")

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
        mtp = 0 if cfg.dspark is not None else len(cfg.mtp_layer_types)
        self.mtp = torch.nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + i, quant, tp) for i in range(mtp)
        )
        # (built only to speculate with it: V4-Flash's head is three layers of 256 experts)
        self.dspark = DSparkHead(cfg, quant, tp) if cfg.dspark and cfg.draft_layers else None
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.rope_tables = torch.nn.ModuleDict(
            {
                "main": RotaryTable(cfg.rope_main, cfg.rope_dim),
                "compress": RotaryTable(cfg.rope_compress, cfg.rope_dim),
            }
        )

    def counters(self) -> dict[str, tuple[str, int]]:
        return {}  # (nothing beyond the engine's own)

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
        taps = []
        for i, layer in enumerate(self.layers):
            streams = layer(streams, step)
            if self.dspark is not None and (tap := self.dspark.tap(i, streams)) is not None:
                taps.append(tap)
        if self.dspark is not None:
            with profiled("draft"):
                self.dspark.write_context(taps, step)
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

    @torch.inference_mode()
    def draft_block(
        self, pool: KVPool, inputs: StepInputs, anchors: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The DSpark head over blocks of `inputs.block` rows (one span each: the anchor, then
        noise tokens), anchors [B] their first tokens -> (drafts [B, gamma] among the first
        `vocab` ids, their confidences [B, gamma] fp32, or None without a confidence head)."""
        head = self.dspark
        assert head is not None
        step = self._step(pool, inputs)
        with profiled("draft"):
            h = head(self.embed(inputs.token_ids), step)  # [B * gamma, hidden]
            base = self.head(head.norm(h))  # [B * gamma, V] fp32
            b = anchors.shape[0]
            return draft_block(
                base.view(b, -1, base.shape[-1]),
                h.view(b, -1, h.shape[-1]),
                anchors,
                head.markov_head,
                head.confidence_head,
                vocab,
            )

    def _step(self, pool: KVPool, inputs: StepInputs) -> StepState:
        return StepState(
            pool, inputs, {k: cast(RotaryTable, t) for k, t in self.rope_tables.items()}
        )
