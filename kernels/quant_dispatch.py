"""Public entry points of the quantized (FP8 / FP4) kernels: Triton for CUDA tensors, the exact
plain-torch reference (kernels.quant) for CPU tensors; ``kernels.use_backend`` forces one
("naive" has no quantized variant and runs Triton).

Named apart from the modules kernels.act_quant and kernels.fp4_moe so that exporting them from
the package does not shadow those modules.
"""

from __future__ import annotations

import torch

from kernels import act_quant as _act_quant
from kernels import fp4_moe as _fp4_moe
from kernels import fp8_gemm as _fp8_gemm
from kernels import hopper, quant
from kernels.dispatch import _forced
from kernels.env import GLUON


def _triton(t: torch.Tensor) -> bool:
    forced = _forced.get()
    return forced in ("triton", "naive") or (forced is None and t.is_cuda)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 128 == 0) -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/128]): the
    release's act_quant with power-of-two (ue8m0) scales; see kernels.quant."""
    return (_act_quant.act_quant if _triton(x) else quant.act_quant_reference)(x)


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
    if _triton(x):
        return _fp8_gemm.fp8_linear(x, weight, scale, out_dtype=out_dtype)
    return quant.fp8_linear_reference(x, weight, scale, out_dtype)


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
    outside [0, E) add nothing (under expert parallelism: the experts of other ranks). On an
    sm_90 device the Gluon kernel runs (kernels.hopper.fp4_moe; its faster decode where the
    caller says every scale byte is <= 128: kernels.quant.narrow_fp4_scales), unless a backend
    is forced."""
    if _forced.get() is None and _gluon_moe(x, w13):
        from kernels.hopper.fp4_moe import fp4_moe_hopper

        return fp4_moe_hopper(
            x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit, narrow_scales=narrow_scales
        )
    if _triton(x):
        return _fp4_moe.fp4_moe(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)
    return quant.fp4_experts_reference(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)


def _gluon_moe(x: torch.Tensor, w13: torch.Tensor) -> bool:
    if not (GLUON and x.is_cuda and hopper.available(x.device)):
        return False
    from kernels.hopper.fp4_moe import supported

    return supported(2 * w13.shape[-1], w13.shape[1] // 2)
