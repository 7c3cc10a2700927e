"""Manifold-constrained hyper-connections (mHC): the residual as `hc_mult` mixed streams.

Each sublayer reads one collapsed input from the streams (weights `pre`), and writes back
`post * output + comb^T @ streams` (kernels.hc_merge), where `comb` is pushed towards a
doubly-stochastic matrix by Sinkhorn iterations so the residual mixing cannot blow up across
depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve import kernels
from dsaserve.engine.layers.norm import unweighted_rms_norm
from dsaserve.engine.models.deepseek_v4.config import ModelConfig


class HyperConnection(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = (
            n,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        self.fn = torch.nn.Parameter(
            torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32)
        )
        self.base = torch.nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(
        self,
        streams: torch.Tensor,
        norm_weight: torch.Tensor,
        merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before a sublayer: streams [N, n, D] (first written back with the previous sublayer's
        `merge` = (output, post, comb), if given) -> (streams, post [N, n], comb [N, n, n], the
        sublayer's input [N, D], collapsed and RMS-normalised with `norm_weight`). Fused:
        kernels.hc_pre."""
        return kernels.hc_pre(
            streams,
            self.fn,
            self.base,
            self.scale,
            norm_weight,
            self.iters,
            self.hc_eps,
            self.norm_eps,
            merge,
        )


class HyperHead(torch.nn.Module):
    """Final collapse of the streams into one hidden state before the last norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = torch.nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = (
            torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float())
            + self.eps
        )
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
