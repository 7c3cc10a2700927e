"""The parts of a DeepSeek MoE every family uses: the SwiGLU (clamped, as DeepSeek-V4 has it, or
plain), a gated MLP (a shared expert, or a dense layer) and the routed experts as two grouped
GEMMs, dense (`RoutedExperts`) or with FP8 weights kept (`Fp8Experts`, DeepSeek-V3.2's). The
SwiGLU runs in fp32, as the releases run it, whatever the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve import kernels
from dsaserve.engine.layers.fp8_linear import linear
from dsaserve.engine.layers.parallel import column_parallel
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.kernels.quant import FP8_BLOCK

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up; with a limit (V4) the gate is clipped from above only, the up
    projection on both sides."""
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class GatedMLP(torch.nn.Module):
    """w2(swiglu(w1 x, w3 x)), the release's MLP / Expert names (w1 gate, w2 down, w3 up).

    split: the group that splits the intermediate dim (w1, w3 column parallel, w2 row parallel:
    one fp32 all-reduce); `inter` is then this rank's share. None: replicated."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        *,
        fp8: bool,
        limit: float | None = None,
        split: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.w1 = (
            column_parallel(linear(hidden, inter, fp8)) if split else linear(hidden, inter, fp8)
        )
        self.w2 = linear(inter, hidden, fp8, row_parallel=split)
        self.w3 = (
            column_parallel(linear(hidden, inter, fp8)) if split else linear(hidden, inter, fp8)
        )
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit)
        return self.w2(h.to(x.dtype))


class RoutedExperts(torch.nn.Module):
    """All experts' weights stacked, run as two grouped GEMMs over tokens sorted by expert.

    Shapes are fixed by the token count alone (no host sync), so decode steps stay
    capturable in CUDA graphs. Expert ids outside [0, E) (another rank's experts) sort past
    every group: the GEMMs never reach their rows, and they add nothing.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float | None) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(
            torch.zeros(num_experts, 2 * inter, hidden)
        )  # [E, gate|up, hidden]
        self.w2 = torch.nn.Parameter(torch.zeros(num_experts, hidden, inter))  # [E, hidden, inter]
        self.inter, self.limit = inter, limit

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] -> fp32 [T, hidden]."""
        k, num_experts = expert_ids.shape[1], self.w13.shape[0]
        flat = expert_ids.reshape(-1)
        mine = (flat >= 0) & (flat < num_experts)
        flat = torch.where(mine, flat, num_experts)
        order = torch.argsort(flat, stable=True)  # [T*k] grouped by expert, others last
        token = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts[:num_experts].cumsum(0).to(torch.int32)  # [E] end row of each group
        gate_up = _grouped_mm(x[token], self.w13.transpose(1, 2), offs=offsets)  # [T*k, 2*inter]
        hidden = swiglu(gate_up[:, : self.inter], gate_up[:, self.inter :], self.limit)
        out = _grouped_mm(hidden, self.w2.transpose(1, 2), offs=offsets)  # [T*k, hidden]
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)  # (fp32 router)
        out = torch.where(mine[order].unsqueeze(-1), out, 0)  # rows no GEMM wrote
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(
            0, token, out.float()
        )


class Fp8Experts(torch.nn.Module):
    """All experts' FP8 weights in kernels.fp8_moe's layout, the checkpoint's codes and block
    scales as they are (the loader copies each expert's tensors into its slices):

        w13 [E, 2I, H] e4m3 (rows 0..I-1: w1 = gate, I..2I-1: w3 = up), s13 [E, 2I/128, H/128] e8m0
        w2  [E, H, I] e4m3, s2 [E, H/128, I/128] e8m0

    Arithmetic: the DeepSeek-V3.2 release's Expert.forward (FP8 activations, bf16 outputs, the
    routing weight applied to each expert's output, summed in fp32): kernels.fp8_experts."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()

        def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        e4m3, e8m0, b = torch.float8_e4m3fn, torch.float8_e8m0fnu, FP8_BLOCK
        self.w13 = param(num_experts, 2 * inter, hidden, dtype=e4m3)
        self.s13 = param(num_experts, 2 * inter // b, hidden // b, dtype=e8m0)
        self.w2 = param(num_experts, hidden, inter, dtype=e4m3)
        self.s2 = param(num_experts, hidden // b, inter // b, dtype=e8m0)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] -> fp32 [T, hidden]."""
        return kernels.fp8_experts(x, expert_ids, weights, self.w13, self.s13, self.w2, self.s2)
