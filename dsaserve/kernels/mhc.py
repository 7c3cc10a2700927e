"""mHC mixing weights in one kernel: pre/post gates and the Sinkhorn-normalised comb matrix.

From each row's projected mixes [(2 + n) * n] (fp32) it computes
    pre  = sigmoid(m[:n] * s0 + b[:n]) + eps
    post = 2 * sigmoid(m[n:2n] * s1 + b[n:2n])
    comb = sinkhorn(softmax_rows(m[2n:].view(n, n) * s2 + b[2n:]) + eps)
with `iters` Sinkhorn sweeps. In plain torch that is ~90 tiny launches per call (two calls a
layer); here it is one, every row's n x n matrix living in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 32


@triton.jit
def hc_mix_weights(pre, post, c, base_ptr, scale_ptr, eps, N: tl.constexpr, ITERS: tl.constexpr):
    """Mixes of R rows, pre and post [R, N] and c [R, N, N] fp32 (in registers), to the weights
    (pre, post, comb) of the module docstring. Shared with kernels.fused_mhc, which computes the
    mixes in registers."""
    i = tl.arange(0, N)
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre * s_pre + tl.load(base_ptr + i)[None, :]) + eps
    post = 2 * tl.sigmoid(post * s_post + tl.load(base_ptr + N + i)[None, :])
    cell = i[:, None] * N + i[None, :]  # [N, N] offsets of comb
    c = c * s_comb + tl.load(base_ptr + 2 * N + cell)[None, :, :]  # [R, N, N]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return pre, post, c


@triton.jit
def _hc_weights_kernel(
    mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    rows, eps,
    N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] rows
    live = r < rows
    i = tl.arange(0, N)
    width = (2 + N) * N
    row = mix_ptr + r[:, None] * width  # [BLOCK, 1]
    cell = i[:, None] * N + i[None, :]  # [N, N] offsets of comb
    pre, post, c = hc_mix_weights(
        tl.load(row + i[None, :], mask=live[:, None], other=0.0),
        tl.load(row + N + i[None, :], mask=live[:, None], other=0.0),
        tl.load(row[:, :, None] + 2 * N + cell[None, :, :], mask=live[:, None, None], other=0.0),
        base_ptr,
        scale_ptr,
        eps,
        N,
        ITERS,
    )
    tl.store(pre_ptr + r[:, None] * N + i[None, :], pre, mask=live[:, None])
    tl.store(post_ptr + r[:, None] * N + i[None, :], post, mask=live[:, None])
    tl.store(comb_ptr + r[:, None, None] * N * N + cell[None, :, :], c, mask=live[:, None, None])


def hc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [R, (2+n)*n] fp32, base [(2+n)*n], scale [3] -> pre [R, n], post [R, n],
    comb [R, n, n]."""
    assert n & (n - 1) == 0, "the kernel needs a power-of-two stream count"
    mixes = mixes.contiguous().float()
    rows = mixes.shape[0]
    pre = torch.empty(rows, n, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=mixes.device)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    _hc_weights_kernel[grid](
        mixes, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, rows, eps,
        N=n, ITERS=iters, BLOCK=ROWS_PER_PROGRAM,
    )  # fmt: skip
    return pre, post, comb
