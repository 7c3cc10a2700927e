"""DeepSeek-V3.2 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

Parameter names follow DeepSeek's release (`layers.N.attn.wq_a.weight`, `layers.N.ffn.gate.bias`,
...); weights.py maps HF's names onto them. Each block is pre-norm attention then pre-norm
feed-forward, each added to the residual stream.

The multi-token-prediction layers (`mtp.N.*`, stored by the HF checkpoint as layers num_layers +
N) are built and loaded but not run by `forward` (speculative decoding will): for the last
layer's output h at position t and the embedding e of token t + 1,

    x = eh_proj(cat(enorm(e), hnorm(h)))      # [hidden]
    x = block(x)                              # attention at position t + 1
    logits = head(norm(x))                    # the draft of token t + 2 (the main head)

Under tensor parallelism (`tp`) every rank builds its shard: the vocabulary-parallel embedding
and head, attention split by heads, the MoE by experts, dense MLPs by their intermediate dim
(their modules say how); norms and routers are replicated.
"""

from __future__ import annotations

from typing import cast

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.models.deepseek_v32.attention import Attention
from dsaserve.engine.models.deepseek_v32.config import KV_GROUP, ModelConfig, Quantization
from dsaserve.engine.models.deepseek_v32.moe import feed_forward
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepInputs, StepState


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
        self.attn = Attention(cfg, layer, quant, tp)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = feed_forward(cfg, layer, quant, tp)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, step: StepState) -> torch.Tensor:
        """x [N, hidden] -> same; slots [N] each row's own slot in the pool."""
        x = x + self.attn(self.attn_norm(x), slots, step)
        with profiled("moe"):
            return x + self.ffn(self.ffn_norm(x))


class MTPLayer(Block):
    """A Block (same parameter names, so `mtp.i.attn.wq_a.weight` loads like a layer's) plus
    the projection and norms that feed it the next token's embedding (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(cfg, layer, quant, tp)
        # dense in the HF checkpoint (vLLM builds it as a plain nn.Linear), replicated
        self.eh_proj = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV32(torch.nn.Module):
    cuda_graphs = True
    # (dropped by the loader when the checkpoint stores none)
    optional_modules: tuple[str, ...] = ("mtp",)

    def __init__(
        self, cfg: ModelConfig, quant: Quantization | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        """quant: the checkpoint's FP8 linears kept in memory and computed as the release does;
        None: every weight dense, in the default dtype. tp: the group this rank's shard belongs
        to."""
        super().__init__()
        self.cfg, self.quant, self.tp = cfg, quant, tp
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(Block(cfg, i, quant, tp) for i in range(cfg.num_layers))
        self.mtp = torch.nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + i, quant, tp) for i in range(cfg.num_mtp_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.rope_tables = torch.nn.ModuleDict(
            {"main": RotaryTable(cfg.rope, cfg.qk_rope_head_dim)}
        )

    def counters(self) -> dict[str, tuple[str, int]]:
        return {}  # (nothing beyond the engine's own)

    @torch.inference_mode()
    def forward(self, pool: KVPool, inputs: StepInputs, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(logit_rows), vocab] of the selected rows."""
        step = StepState(
            pool, inputs, {k: cast(RotaryTable, t) for k, t in self.rope_tables.items()}
        )
        # every row's own slot (a token's row never moves), shared by all layers
        slots = step.entry_slots(KV_GROUP, inputs.row_req, inputs.positions)  # [N]
        with profiled("embed"):
            x = self.embed(inputs.token_ids)
        for layer in self.layers:
            x = layer(x, slots, step)
        with profiled("head"):
            return self.head(self.norm(x[logit_rows]))
