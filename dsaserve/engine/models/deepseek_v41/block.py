"""One DeepSeek-V4.1 layer: Engram (on its layers), attention and MoE between mHC stream mixes.

From DeepSeek's inference/model.py `Block` and `Engram`. The residual is `hc_mult` streams, as in
V4, but a sublayer's input is collapsed with the weights the sublayer BEFORE it computed:
each sublayer's mixes of the streams it reads give its own write-back (post, comb) and the
next sublayer's collapse (pre); the first layer's attention collapses with (1, 0, ..., 0), and
the head with the last MoE's. No hyper head: the last collapse feeds the final norm.

    mixes(S) = hc_weights(rms-scaled flatten(S) @ fn^T, base, scale)    (kernels.hc_weights)
    attention:  x = attn_norm(sum_i pre_prev_i S_i); S' = post_a * attn(x) + comb_a^T S
    MoE:        x = ffn_norm(sum_i pre_a_i S'_i);    S'' = post_f * moe(x) + comb_f^T S'
    -> (S'', pre_f)

Engram, before the block on its layers, adds a table row mix to every stream, gated per
stream by a normalized match: kv = wkv(rows), key_i = kv[i] (per stream), value = kv[n];
g_i = sigmoid(signed sqrt(<S_i, q_w * k_w * key_i> / (rms(S_i) rms(key_i) sqrt(D)))), with
|.| clamped at 1e-6 before the root; S_i += g_i * value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.norm import RMSNorm
from dsaserve.engine.models.deepseek_v4.config import Quantization
from dsaserve.engine.models.deepseek_v4.moe import MoE
from dsaserve.engine.models.deepseek_v41.attention import Attention, StepShared
from dsaserve.engine.models.deepseek_v41.config import ModelConfig
from dsaserve.engine.models.deepseek_v41.engram_table import EngramTable
from dsaserve.engine.models.deepseek_v41.rows import Rows
from dsaserve.engine.parallel.group import SINGLE, TensorParallel
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.step import StepState

GATE_FLOOR = 1e-6  # Engram's clamp of |dot| before the signed square root (the training kernel's)


class HyperConnection(torch.nn.Module):
    """A sublayer's mHC parameters (the checkpoint's hc_{attn,ffn}_{fn,base,scale})."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = torch.nn.Parameter(
            torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32)
        )
        self.base = torch.nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [M, n, D] -> (pre [M, n], post [M, n], comb [M, n, n]) fp32."""
        flat = streams.flatten(1).float()
        scaled = F.linear(flat, self.fn) * torch.rsqrt(
            flat.square().mean(-1, keepdim=True) + self.norm_eps
        )
        return kernels.hc_weights(scaled, self.base, self.scale, self.n, self.iters, self.hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i * streams[:, i] in fp32 -> [M, D] in the streams' dtype."""
    return (pre[..., None] * streams.float()).sum(1).to(streams.dtype)


class Engram(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, quant: Quantization | None = None) -> None:
        super().__init__()
        assert cfg.engram is not None
        e, n, d = cfg.engram, cfg.hc_mult, cfg.hidden_size
        self.n, self.dim, self.eps = n, d, cfg.rms_norm_eps
        block = quant.block if quant else 0
        self.wkv = linear(e.hash_cols * e.head_dim, d * (n + 1), quant is not None, block=block)
        self.q_weight = torch.nn.Parameter(torch.ones(n, d))
        self.k_weight = torch.nn.Parameter(torch.ones(n, d))
        self.table: EngramTable | None = None  # its rows, host-resident (set at load)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """streams [M, n, D], ids [M, hash_cols] (offset into the table) -> streams."""
        assert self.table is not None, "the Engram table was not loaded"
        with profiled("engram_lookup"):
            rows = self.table.lookup(ids.reshape(-1)).view(ids.shape[0], -1)  # [M, cols * dim]
        kv = self.wkv(rows)
        key, value = kv.split([self.n * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.n, self.dim))  # [M, n, D]
        weight = self.q_weight.float() * self.k_weight.float()
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        dot = (h * weight * key).sum(-1) * rstd * self.dim**-0.5  # [M, n]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        return (h + gate[..., None] * value.float()[:, None, :]).to(streams.dtype)


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
        layers = cfg.engram.layer_ids if cfg.engram else ()
        self.engram = Engram(cfg, quant) if layer in layers else None
        self.engram_index = layers.index(layer) if layer in layers else -1

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        step: StepState,
        shared: StepShared,
        hashes: torch.Tensor | None,
        rows_in: Rows | None,
        rows_out: Rows | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [N, n, D] and pre [N, n] (the previous sublayer's collapse weights) of every
        row of the step -> both with the rows of `rows_out` updated (None: all rows); reads the
        rows of `rows_in`. hashes: the Engram ids [N, Engram layers, cols] (None: none)."""
        if rows_in is not None and not len(rows_in.index):
            return self._skip(streams, pre)  # (no row of the step needs this layer)
        take = (lambda t: t) if rows_in is None else (lambda t: t[rows_in.index])
        h = take(streams)
        if self.engram is not None:
            assert hashes is not None
            with profiled("engram"):
                h = self.engram(h, take(hashes[:, self.engram_index]))
        with profiled("mhc"):
            x = self.attn_norm(collapse(h, take(pre)))
        out = self.attn(x, step, shared, rows_in, rows_out)
        if rows_out is not None and not len(rows_out.index):
            return self._skip(streams, pre)  # (its KV was all it had to compute)
        if rows_out is not None:
            at = (
                rows_out.index
                if rows_in is None
                else torch.searchsorted(rows_in.index, rows_out.index)
            )
            h = h[at]
        with profiled("mhc"):
            pre_attn, post, comb = self.hc_attn.mixes(h)
            h = kernels.hc_merge(h.contiguous(), out, post, comb)
            pre_ffn, post, comb = self.hc_ffn.mixes(h)
            x = self.ffn_norm(collapse(h, pre_attn))
        token_ids = step.inp.token_ids if rows_out is None else step.inp.token_ids[rows_out.index]
        with profiled("moe"):
            out = self.ffn(x, token_ids)
        with profiled("mhc"):
            h = kernels.hc_merge(h, out, post, comb)
        if rows_out is None:
            return h, pre_ffn
        return (
            streams.index_copy(0, rows_out.index, h),
            pre.index_copy(0, rows_out.index, pre_ffn),
        )

    def _skip(self, streams: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer none of whose outputs the step needs. Under expert parallelism the other
        engines' ranks still meet this layer's MoE in its all-to-alls (their steps trim other
        rows): it runs on no rows."""
        if self.ffn.tp.ep is not None:
            none = streams.new_empty(0, streams.shape[-1])  # [0, hidden]
            self.ffn(none, torch.empty(0, dtype=torch.int64, device=streams.device))
        return streams, pre
