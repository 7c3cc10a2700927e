"""Linear layers whose weights stay in the DeepSeek-V4 release's FP8 block format.

    weight [out, in] float8_e4m3fn, scale [ceil(out/128), ceil(in/128)] float8_e8m0fnu

The names match the checkpoint's (`<name>.weight`, `<name>.scale`), so the loader copies both
as they are. `forward` is the release's `linear()`: the activations are quantized to FP8 per 128
values (power-of-two scales), then a block-scaled FP8 GEMM gives bf16, as `kernels.fp8_linear`
computes it (Triton on the GPU, the exact torch reference on the CPU).

Row parallel (`tp` given: the input dim is split across a tensor-parallel group, the release's
wo_b): each rank's GEMM keeps its fp32 sums, the group adds them in fp32, and the result is
rounded to bf16 once, where the unsplit GEMM rounds; the release rounds each rank's partial
product to bf16 first, so here the group computes what one rank computes.
"""

from __future__ import annotations

import torch

from dsaserve import kernels
from dsaserve.engine.layers.parallel import RowParallelLinear
from dsaserve.engine.parallel.group import SINGLE, TensorParallel, shard
from dsaserve.kernels.quant import FP8_BLOCK


class Fp8Linear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE) -> None:
        """in_features: this rank's share when `tp` splits the input dim (row parallel)."""
        super().__init__()
        if in_features % FP8_BLOCK:
            # the release quantizes activations per 128 and asserts it
            raise ValueError(f"FP8 linear: in_features {in_features} is not a multiple of 128")
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
            requires_grad=False,
        )
        blocks = (-(-out_features // FP8_BLOCK), in_features // FP8_BLOCK)
        self.scale = torch.nn.Parameter(
            torch.empty(blocks, dtype=torch.float8_e8m0fnu), requires_grad=False
        )
        self.tp = tp
        if tp.size > 1:
            shard(self.weight, 1)
            shard(self.scale, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (the GEMM itself writes bf16, as the release)."""
        if self.tp.size == 1:
            return kernels.fp8_linear(x, self.weight, self.scale).to(x.dtype)
        partial = kernels.fp8_linear(x, self.weight, self.scale, out_dtype=torch.float32)
        return self.tp.all_reduce(partial).to(torch.bfloat16).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def linear(
    in_features: int, out_features: int, fp8: bool, row_parallel: TensorParallel | None = None
) -> torch.nn.Module:
    """A bias-free linear layer: FP8 weights (kept quantized) or dense ones in the default dtype.
    row_parallel: the group that splits its input dim (in_features is this rank's share)."""
    if fp8:
        return Fp8Linear(in_features, out_features, row_parallel or SINGLE)
    if row_parallel is not None:
        return RowParallelLinear(in_features, out_features, row_parallel)
    return torch.nn.Linear(in_features, out_features, bias=False)
