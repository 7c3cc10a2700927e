"""mHC around each sublayer in two launches: write-back + mixing GEMM, then weights + collapse.

The engine's mHC boundary after a sublayer is ~13 launches: merge_streams (two casts, a
broadcast product, a batched matmul, an add), then HyperConnection (an fp32 copy of the
streams, an RMS norm, the [N, n*D] x [n*D, (2+n)*n] fp32 GEMM, the weights kernel, a product,
a sum, a cast) and the sublayer's RMSNorm. Here:

1. ``_hc_mix_kernel``, grid (row blocks, splits of D; about two programs per SM): each program
   walks its slice of the hidden channels BLOCK_D at a time, one output stream at a time: merges
   the tile (post * out + comb^T @ streams, rounded as the engine rounds) and writes it, then
   multiplies it, still in registers, with fn's matching columns (fp32 tl.dot, IEEE) and sums
   its squares: split-K partials [splits, N, (2+n)*n] and [splits, N]. RMS normalisation is a
   per-row scalar, so it commutes with the GEMM and is applied to the sums.
2. ``_hc_finish_kernel``, grid (N,): sums a row's partials in a fixed order (deterministic),
   scales them by rsqrt(mean square + eps), turns them into (pre, post, comb) with
   kernels.mhc's jit function (sigmoids, Sinkhorn), then collapses the row's streams with pre,
   rounds to the model dtype and applies the sublayer's RMSNorm.
Without a write-back (the first sublayer) step 1 only reads; hc_merge (the last write-back,
before the head) is step 1 without the GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.env import num_sms
from dsaserve.kernels.fused_common import round_to
from dsaserve.kernels.mhc import hc_mix_weights

MIX_ROWS = 16  # rows per mix program: tl.dot's smallest M
MIX_BLOCK = 32  # hidden channels per step of a mix program (the dot's K per stream)


@triton.jit
def _hc_mix_kernel(
    streams_ptr,  # [N, NS, D]
    out_ptr,  # [N, D] the sublayer's output (MERGE)
    post_ptr,  # [N, NS] fp32 (MERGE)
    comb_ptr,  # [N, NS, NS] fp32 (MERGE)
    new_ptr,  # [N, NS, D] merged streams (MERGE)
    fn_ptr,  # [M, NS * D] fp32 (MIX)
    dot_ptr,  # [splits, N, M] fp32 partial mixes (MIX)
    sq_ptr,  # [splits, N] fp32 partial sums of squares (MIX)
    rows, D,
    cols,  # hidden channels per split, a multiple of BLOCK_D
    NS: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, MERGE: tl.constexpr, MIX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    DTYPE: tl.constexpr = streams_ptr.dtype.element_ty
    split = tl.program_id(1)
    r = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m = tl.arange(0, M_PAD)
    row_live = r < rows
    dot = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    for d0 in range(split * cols, tl.minimum(split * cols + cols, D), BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        live = row_live[:, None] & (d < D)[None, :]  # [BLOCK_N, BLOCK_D]
        tile = r[:, None] * (NS * D) + d[None, :]  # stream 0 of the tile; stream j at + j * D
        for j in tl.static_range(NS):  # one output stream at a time: 2-D tiles only
            if MERGE:
                # new_j = post_j * out + sum_i comb[i, j] * streams_i: each term rounded to the
                # model dtype (a broadcast product and a bmm in the engine), then their sum
                acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
                for i in tl.static_range(NS):
                    c = tl.load(comb_ptr + r * (NS * NS) + i * NS + j, mask=row_live, other=0.0)
                    s = tl.load(streams_ptr + tile + i * D, mask=live, other=0.0).to(tl.float32)
                    acc += round_to(c, DTYPE)[:, None] * s
                p = round_to(tl.load(post_ptr + r * NS + j, mask=row_live, other=0.0), DTYPE)
                o = tl.load(out_ptr + r[:, None] * D + d[None, :], mask=live, other=0.0)
                x = round_to(p[:, None] * o.to(tl.float32), DTYPE) + round_to(acc, DTYPE)
                x = round_to(x, DTYPE)
                tl.store(new_ptr + tile + j * D, x.to(DTYPE), mask=live)
            else:
                x = tl.load(streams_ptr + tile + j * D, mask=live, other=0.0).to(tl.float32)
            if MIX:  # x_j's share of flatten(streams) @ fn^T: fn's columns j * D + d
                f = tl.load(
                    fn_ptr + m[None, :] * (NS * D) + (j * D + d)[:, None],
                    mask=(d < D)[:, None] & (m < M)[None, :],
                    other=0.0,
                )  # [BLOCK_D, M_PAD]
                dot = tl.dot(x, f, dot, input_precision="ieee")
                sq += tl.sum(x * x, axis=1)
    if MIX:
        part = (split * rows + r)[:, None] * M + m[None, :]
        tl.store(dot_ptr + part, dot, mask=row_live[:, None] & (m < M)[None, :])
        tl.store(sq_ptr + split * rows + r, sq, mask=row_live)


@triton.jit
def _hc_finish_kernel(
    dot_ptr,  # [splits, N, M] fp32
    sq_ptr,  # [splits, N] fp32
    base_ptr,  # [M] fp32
    scale_ptr,  # [3] fp32
    streams_ptr,  # [N, NS, D] (merged)
    w_ptr,  # [D] fp32 the sublayer's norm weight
    post_ptr,  # [N, NS] fp32
    comb_ptr,  # [N, NS, NS] fp32
    x_ptr,  # [N, D] the normalised collapsed input
    rows, splits, D, hc_eps, norm_eps,
    NS: tl.constexpr, ITERS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    M: tl.constexpr = (2 + NS) * NS
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    live = s < splits
    i = tl.arange(0, NS)
    cell = i[:, None] * NS + i[None, :]  # [NS, NS]
    part = dot_ptr + (s * rows + b) * M  # [BLOCK_S] this row's partials
    sq = tl.sum(tl.load(sq_ptr + s * rows + b, mask=live, other=0.0), axis=0)
    inv = tl.rsqrt(sq / (NS * D) + norm_eps)
    pre = tl.sum(tl.load(part[:, None] + i[None, :], mask=live[:, None], other=0.0), axis=0)
    post = tl.sum(tl.load(part[:, None] + NS + i[None, :], mask=live[:, None], other=0.0), axis=0)
    comb = tl.sum(
        tl.load(
            part[:, None, None] + 2 * NS + cell[None, :, :], mask=live[:, None, None], other=0.0
        ),
        axis=0,
    )
    pre, post, comb = hc_mix_weights(
        (pre * inv)[None, :],
        (post * inv)[None, :],
        (comb * inv)[None, :, :],
        base_ptr,
        scale_ptr,
        hc_eps,
        NS,
        ITERS,
    )  # [1, NS], [1, NS], [1, NS, NS]
    tl.store(post_ptr + b * NS + i[None, :], post)
    tl.store(comb_ptr + b * NS * NS + cell[None, :, :], comb)
    d = tl.arange(0, BLOCK_D)
    dl = d < D
    st = tl.load(
        streams_ptr + b * NS * D + i[:, None] * D + d[None, :], mask=dl[None, :], other=0.0
    ).to(tl.float32)  # [NS, BLOCK_D]
    x = round_to(tl.sum(tl.reshape(pre, (NS, 1)) * st, axis=0), DTYPE)  # collapsed input
    y = tl.load(w_ptr + d, mask=dl, other=0.0) * (
        x * tl.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
    )
    tl.store(x_ptr + b * D + d, y.to(DTYPE), mask=dl)


def _mix(
    streams: torch.Tensor,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch _hc_mix_kernel: (merged streams or the input, partial mixes, partial squares)."""
    rows, ns, dim = streams.shape
    assert streams.is_contiguous() and ns & (ns - 1) == 0, "contiguous, power-of-two streams"
    # about two programs per SM, from the shape only (CUDA graphs); fewer splits, less partials
    row_blocks, blocks = triton.cdiv(rows, MIX_ROWS), triton.cdiv(dim, MIX_BLOCK)
    cols = triton.cdiv(blocks, min(blocks, triton.cdiv(2 * num_sms(streams.device), row_blocks)))
    cols *= MIX_BLOCK
    splits = triton.cdiv(dim, cols)
    new = torch.empty_like(streams) if merge is not None else streams
    if merge is not None:
        assert all(t.is_contiguous() for t in merge)
    width = fn.shape[0] if fn is not None else 0
    dot = sq = None
    if fn is not None:
        dot = torch.empty(splits, rows, width, dtype=torch.float32, device=streams.device)
        sq = torch.empty(splits, rows, dtype=torch.float32, device=streams.device)
    if rows:
        out, post, comb = merge if merge is not None else (streams, streams, streams)
        _hc_mix_kernel[(row_blocks, splits)](
            streams, out, post, comb, new,
            fn.float().contiguous() if fn is not None else streams,
            dot if dot is not None else streams,
            sq if sq is not None else streams,
            rows, dim, cols,
            NS=ns, M=width, M_PAD=max(16, triton.next_power_of_2(width)), MERGE=merge is not None,
            MIX=fn is not None, BLOCK_N=MIX_ROWS, BLOCK_D=MIX_BLOCK,
            num_warps=8,
        )  # fmt: skip
    return new, dot, sq


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Triton path of kernels.hc_merge (semantics there)."""
    return _mix(streams, (out, post, comb), None)[0]


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton path of kernels.hc_pre (semantics there)."""
    streams, dot, sq = _mix(streams, merge, fn)
    assert dot is not None and sq is not None  # (fn given: the partial mixes exist)
    rows, ns, dim = streams.shape
    post = torch.empty(rows, ns, dtype=torch.float32, device=streams.device)
    comb = torch.empty(rows, ns, ns, dtype=torch.float32, device=streams.device)
    x = torch.empty(rows, dim, dtype=streams.dtype, device=streams.device)
    if rows:
        _hc_finish_kernel[(rows,)](
            dot, sq, base.float().contiguous(), scale.float().contiguous(), streams,
            norm_weight.float().contiguous(), post, comb, x, rows, dot.shape[0], dim, hc_eps,
            norm_eps,
            NS=ns, ITERS=iters, BLOCK_S=triton.next_power_of_2(dot.shape[0]),
            BLOCK_D=triton.next_power_of_2(dim),
            num_warps=8,
        )  # fmt: skip
    return streams, post, comb, x
