"""DeepSeek-V4.1 for causal LM over a flat batch of rows (prefill chunks and decode tokens).

embed -> hc_mult copies of it -> 40 blocks (Engram on its layers; attention over a window and
CSA2 entries; MoE; mHC mixes whose collapse weights the previous sublayer computed) -> the last
MoE's collapse -> norm -> head (DeepSeek's inference/model.py `Transformer.forward`).

Parameter names are the release's (`layers.N.attn.wq_a.weight`, `layers.N.engram.wkv.weight`,
...; engine.models.deepseek_v41.weights maps HF-style spellings onto them). The Engram tables are
not parameters: they stay in host memory (engine.models.deepseek_v41.engram_table), attached at
load. The vision tower and the DSpark draft head are not built: images are refused by the chat
formats and speculative decoding by this family (the draft head's target layers are recorded in
the config for the head to come).

Prefill trims the layers after the last KV source to the rows the state at each anchor needs
(engine.models.deepseek_v41.rows). A step reads host data to plan that and to run the indexer
request by request, so decode steps run eagerly (`cuda_graphs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.models.deepseek_v4.config import Quantization
from dsaserve.engine.models.deepseek_v41.attention import StepShared
from dsaserve.engine.models.deepseek_v41.block import Block, Engram, collapse
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.models.deepseek_v41.engram import EngramHasher
from dsaserve.engine.models.deepseek_v41.rows import RowPlan
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepInputs, StepState


class DeepseekV41(torch.nn.Module):
    cuda_graphs = False  # (a step plans on the host: module docstring)
    # none: the DSpark head's tensors (`mtp.*`) are skipped by name (weights._NOT_SERVED)
    optional_modules: tuple[str, ...] = ()

    def __init__(
        self, cfg: ModelConfig, quant: Quantization | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        """quant: the checkpoint's formats kept in memory (FP8 linears in 32 x 32 blocks, FP4
        experts), computed as the release does; None: every weight dense in the default dtype.
        tp: the group this rank's shard belongs to."""
        super().__init__()
        self.cfg, self.quant, self.tp = cfg, quant, tp
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(Block(cfg, i, quant, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.rope_tables = torch.nn.ModuleDict(
            {
                "main": RotaryTable(cfg.rope_main, cfg.rope_dim),
                "compress": RotaryTable(cfg.rope_compress, cfg.rope_dim),
            }
        )
        self.hasher = EngramHasher(cfg.engram, cfg.vocab_size) if cfg.engram else None
        self.mtp = torch.nn.ModuleList()  # (no MTP layer: what the loader looks for)

    def engrams(self) -> list[Engram]:
        """The Engram modules, layer by layer."""
        return [e for b in self.layers if (e := cast(Block, b).engram) is not None]

    def counters(self) -> Mapping[str, tuple[str, int]]:
        """Cumulative counts the worker exports (name -> (help, value)): Engram's lookups and
        those its device caches answered."""
        stats = [e.table.stats() for e in self.engrams() if e.table is not None]
        return {
            "engram_lookups": ("Engram table rows looked up", sum(s[0] for s in stats)),
            "engram_cache_hits": (
                "Engram rows served by the device cache of hot rows",
                sum(s[1] for s in stats),
            ),
        }

    @torch.inference_mode()
    def forward(self, pool: KVPool, inputs: StepInputs, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(logit_rows), vocab] of the selected rows (rows
        the last layer computes: the anchors' last rows, decode rows, untrimmed spans')."""
        step = StepState(
            pool, inputs, {k: cast(RotaryTable, t) for k, t in self.rope_tables.items()}
        )
        plan = RowPlan(self.cfg, inputs, pool.ring_len)
        with profiled("embed"):
            x = self.embed(inputs.token_ids)
        n = self.cfg.hc_mult
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()  # [N, n, hidden]
        pre = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # the first attention reads the first copy
        hashes = None
        if self.hasher is not None:
            assert inputs.lookback is not None
            with profiled("engram"):
                hashes = self.hasher(
                    inputs.token_ids,
                    inputs.positions,
                    inputs.row_req,
                    inputs.req_past,
                    inputs.req_row0,
                    inputs.lookback,
                )  # [N, Engram layers, cols]
        shared = StepShared()
        for i, layer in enumerate(self.layers):
            streams, pre = layer(
                streams, pre, step, shared, hashes, plan.inputs[i], plan.outputs[i]
            )
        with profiled("head"):
            h = collapse(streams[logit_rows], pre[logit_rows])
            return self.head(self.norm(h))
