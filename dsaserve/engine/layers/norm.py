"""RMS norms as DeepSeek-V4 uses them (statistics and weights in fp32, one cast at the end)."""

from __future__ import annotations

import torch

from dsaserve import kernels


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector RMS normalisation without a weight (query heads, mHC inputs)."""
    return kernels.rms_norm(x, None, eps)
