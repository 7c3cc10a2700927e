"""The lightning indexer's query side in one launch: RoPE of q, weight scaling, entry counts.

The engine runs RoPE (one kernel), weights_proj(x).float() * Hi^-0.5 (two), and
(positions + 1) // rate as int32 (two) for every CSA layer of every step. Here one program per
row rotates the rope channels of its Hi query heads in place (the nope channels are neither
read nor written), scales its weights into fp32 and writes its entry count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.fused_common import rope_in_place


@triton.jit
def _indexer_query_kernel(
    q_ptr,  # [N, HI, DI] rotated in place
    w_ptr,  # [N, HI] raw weights (any float dtype)
    cos_ptr,  # [N, HALF]
    sin_ptr,  # [N, HALF]
    pos_ptr,  # [N] int64
    w_out_ptr,  # [N, HI] fp32
    len_ptr,  # [N] int32
    rate, scale,
    HI: tl.constexpr, DI: tl.constexpr, HALF: tl.constexpr, BLOCK_HI: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HI)
    live = h < HI
    rope_in_place(q_ptr, b * HI + h, live, b + 0 * h, cos_ptr, sin_ptr, 1.0, DI, HALF, BLOCK_H)
    w = tl.load(w_ptr + b * HI + h, mask=live, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + b * HI + h, w * scale, mask=live)
    tl.store(len_ptr + b, ((tl.load(pos_ptr + b) + 1) // rate).to(tl.int32))


def indexer_query(
    q: torch.Tensor,
    weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rate: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton path of kernels.indexer_query (semantics there): q is rotated in place."""
    n, heads, head_dim = q.shape
    half = cos.shape[-1]
    assert q.is_contiguous() and weights.is_contiguous() and weights.shape == (n, heads)
    w_out = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    lengths = torch.empty(n, dtype=torch.int32, device=q.device)
    if n:
        _indexer_query_kernel[(n,)](
            q, weights, cos.contiguous(), sin.contiguous(), positions, w_out, lengths, rate,
            heads**-0.5,
            HI=heads, DI=head_dim, HALF=half, BLOCK_HI=triton.next_power_of_2(heads),
            BLOCK_H=triton.next_power_of_2(half),
            num_warps=4,
        )  # fmt: skip
    return q, w_out, lengths
