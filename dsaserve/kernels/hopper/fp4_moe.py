"""Routed FP4 experts on Hopper (Gluon): kernels.fp4_moe's grouped GEMMs with the weight stream
behind TMA and the tensor cores fed from registers.

    y = fp4_moe_hopper(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)

Same contract, layouts and arithmetic as ``kernels.fp4_moe.fp4_moe`` (its docstring has them);
H and I multiples of 512 (``supported``). Why a second kernel: the Triton one decodes nibbles
between load and dot, which keeps Triton's pipeliner from overlapping the weight loads, so each
program waits on its loads (about a quarter of the H200's copy rate at decode); this one reaches
73% of it (bench/NOTES-hopper.md).

The parts: kernels.hopper.moe_rows (routing plan, activations, SwiGLU, finish: plain Triton),
kernels.hopper.fp4_gemm (the GEMM, run for gate/up and for down), kernels.hopper.fp4_decode
(FP4 in shared memory to the MMA's register operand). Launches: the plan (one program for a
decode step's rows), the activations, gate/up (fp32 sums per K slice), SwiGLU, down, the
finish. Nothing is read back to the host: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dsaserve.kernels.env import num_sms
from dsaserve.kernels.fp4_moe import check_experts
from dsaserve.kernels.hopper.fp4_decode import DECODES
from dsaserve.kernels.hopper.fp4_gemm import (
    SMEM_BUDGET,
    STEP_K,
    TILE_ROWS,
    grouped_gemm,
    stage_bytes,
)
from dsaserve.kernels.hopper.moe_rows import finish, gather_activations, plan, swiglu


@dataclass(frozen=True)
class HopperMoeConfig:
    block_t: int  # BT: sorted token rows per slot (the MMA's N: 8, 16, 32 or 64)
    stages: int  # TMA ring depth
    split_k: tuple[int, int]  # K slices of (gate/up, down); fp32 partial sums added after
    decode: str = "table"  # "table" (any scale) or "shift" (scale bytes <= 128), see above


def _split_for(items: int, k: int, sms: int) -> int:
    """K slices that bring `items` work items to about four per SM (slices >= STEP_K wide)."""
    split = 1
    while items * split < 4 * sms and k % (2 * split * STEP_K) == 0:
        split *= 2
    return split


def default_config(
    rows: int, experts: int, hidden: int, inter: int, sms: int, narrow_scales: bool = False
) -> HopperMoeConfig:
    """Shape-only choice; rows = T * k. narrow_scales: every weight scale byte is <= 128.
    Decode-sized slots (<= 16 rows an expert) take the "fp8" decode (the fastest there, any
    scale); prefill-sized ones "shift" (or "table"), where fp8's per-group promotion of the
    wider accumulators costs more than the bf16 decode (bench/NOTES-hopper.md)."""
    per_expert = rows / max(min(experts, rows), 1)
    block_t = 8 if per_expert <= 8 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    slots = triton.cdiv(rows, block_t) + min(experts, rows)
    busy = min(slots, min(experts, rows) + rows // block_t)  # slots a typical routing fills
    split = (
        _split_for(busy * (inter // 64), hidden, sms),
        _split_for(busy * (hidden // TILE_ROWS), inter, sms),
    )
    decode = "fp8" if block_t <= 16 else "shift" if narrow_scales else "table"
    stages = max(2, min(6, SMEM_BUDGET // stage_bytes(block_t, decode)))
    return HopperMoeConfig(block_t, stages, split, decode)


def supported(hidden: int, inter: int) -> bool:
    """Shapes the Gluon kernels take (others run kernels.fp4_moe)."""
    return hidden % STEP_K == 0 and inter % STEP_K == 0


def fp4_moe_hopper(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    swiglu_limit: float,
    *,
    config: HopperMoeConfig | None = None,
    narrow_scales: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed FP4 experts on an sm_90 device; contract of kernels.fp4_moe.fp4_moe.
    narrow_scales: the caller knows every weight scale byte is <= 128
    (``kernels.quant.narrow_fp4_scales``), which lets the default config pick the faster
    decode."""
    n_exp, hidden, inter = check_experts(w13, s13, w2, s2)
    if not supported(hidden, inter):
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of {STEP_K}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} vs experts of hidden size {hidden}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} vs x {tuple(x.shape)}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} vs expert_ids {tuple(expert_ids.shape)}")
    tokens, topk = expert_ids.shape
    if tokens * topk == 0:
        return torch.zeros(tokens, hidden, dtype=out_dtype, device=x.device)
    cfg = config or default_config(
        tokens * topk, n_exp, hidden, inter, num_sms(x.device), narrow_scales
    )
    split_up, split_down = cfg.split_k
    if hidden % (split_up * STEP_K) or inter % (split_down * STEP_K) or cfg.decode not in DECODES:
        raise ValueError(f"unsupported config {cfg} for hidden {hidden}, intermediate {inter}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = plan(expert_ids, n_exp, cfg.block_t)
    xg, xs = gather_activations(x, p, topk, cfg.decode)
    tiles = (cfg.block_t, cfg.stages, cfg.decode)
    up = grouped_gemm(w13.view(torch.uint8), s13, xg, xs, p, True, split_up, *tiles)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    hg, hs = swiglu(up, p, route_w, swiglu_limit, cfg.decode)
    down = grouped_gemm(w2.view(torch.uint8), s2, hg, hs, p, False, split_down, *tiles)
    return finish(down, p, tokens, topk).to(out_dtype)
