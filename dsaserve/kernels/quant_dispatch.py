"""Public entry points of the quantized (FP8 / FP4) kernels: Triton for CUDA tensors, the exact
plain-torch reference (kernels.quant) for CPU tensors, by kernels.backend's rule
(``kernels.use_backend`` forces one).

Named apart from the modules kernels.act_quant and kernels.fp4_moe so that exporting them from
the package does not shadow those modules.
"""

from __future__ import annotations

import torch

from dsaserve.kernels import act_quant, fp4_moe, fp8_gemm, fp8_moe, quant
from dsaserve.kernels.backend import uses_gluon, uses_triton


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 128 == 0) -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/128]): the
    release's act_quant with power-of-two (ue8m0) scales; see kernels.quant."""
    return (act_quant.act_quant if uses_triton(x) else quant.act_quant_reference)(x)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The release's linear() on an FP8 weight: x [..., K] -> [..., N] out_dtype (the release
    writes bf16; fp32 keeps the partial sums of a layer split along K for a cross-rank sum).

    weight [N, K] float8_e4m3fn, scale [ceil(N/128), K/128] float8_e8m0fnu; details in
    kernels.fp8_gemm."""
    if uses_triton(x):
        return fp8_gemm.fp8_linear(x, weight, scale, out_dtype=out_dtype)
    return quant.fp8_linear_reference(x, weight, scale, out_dtype)


def fp8_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
) -> torch.Tensor:
    """Routed FP8 experts (DeepSeek-V3.2's) -> fp32 [T, H]; layout and semantics in
    kernels.fp8_moe. Expert ids outside [0, E) add nothing (under expert parallelism: the
    experts of other ranks)."""
    if uses_triton(x):
        return fp8_moe.fp8_moe(x, expert_ids, weights, w13, s13, w2, s2)
    return quant.fp8_experts_reference(x, expert_ids, weights, w13, s13, w2, s2)


def fp4_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
    *,
    narrow_scales: bool = False,
) -> torch.Tensor:
    """Routed FP4 experts -> fp32 [T, H]; layout and semantics in kernels.fp4_moe. Expert ids
    outside [0, E) add nothing (under expert parallelism: the experts of other ranks). Where the
    Gluon kernels run (kernels.backend.uses_gluon) and take the shapes, kernels.hopper.fp4_moe;
    narrow_scales (every scale byte <= 128: kernels.quant.narrow_fp4_scales) lets it pick its
    exact bf16 decode for prefill-sized batches."""
    if uses_gluon(x):
        from dsaserve.kernels.hopper import fp4_moe as hopper_moe

        if hopper_moe.supported(2 * w13.shape[-1], w13.shape[1] // 2):
            return hopper_moe.fp4_moe_hopper(
                x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit, narrow_scales=narrow_scales
            )
    if uses_triton(x):
        return fp4_moe.fp4_moe(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)
    return quant.fp4_experts_reference(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)
