"""Block-scaled FP8 GEMM (Triton): the release's linear() on an FP8 weight.

    y = fp8_linear(x, weight, scale)            # x [..., K] bf16 -> y [..., N] bf16
    y = fp8_gemm(xq, xs, weight, scale)         # pre-quantized: xq [M, K] e4m3, xs [M, K/128]

    weight [N, K] float8_e4m3fn (K-contiguous), scale [ceil(N/128), K/128] float8_e8m0fnu,
    K % 128 == 0 (the release's act_quant asserts it); N is free (a partial last scale row).

Arithmetic (kernels.quant.fp8_linear_reference): per 128-wide K block one fp8 x fp8 tensor-core
dot into a fresh fp32 tile, scaled by x_scale[m] * w_scale[n // 128] and added to the fp32
accumulator, then one rounding to bf16, as the release's fp8_gemm_kernel does (that per-block
promotion is also what keeps Hopper's reduced-precision fp8 accumulation short).

Two regimes, chosen from the shape alone (``default_config``):
- decode (M <= 64) is weight-bandwidth bound: one program covers every row of a BLOCK_N-wide
  weight stripe, so each weight byte is read once; up to 16 rows are quantized inside the GEMM
  (no act_quant launch; the bf16 rows come from L2); when the N stripes cannot fill the GPU the
  K range is split across programs and a second kernel adds the fp32 partials in split order.
- prefill (large M) is tensor-core bound: act_quant runs first, then 128x128 tiles in grouped
  launch order (neighbouring programs share A rows and W columns in L2), fp8 dots (wgmma).

No host synchronisation and shape-only allocation: calls can be captured in CUDA graphs. Under the
interpreter (CPU tests) fp8 operands are upcast to fp32 for an exact fp32 dot.

From the sm_90 SASS (compiled without a GPU by Triton's bundled ptxas): the decode loops issue
~26-42 cycles per KB of weights and SM (HBM at 4 TB/s needs ~64: headroom; quantizing 64 rows
inside would take ~70, hence act_quant first above 16 rows); below 64 rows Triton uses mma.sync
and converts fp8 to fp16 for it (exact). The 128x128 prefill loop waits for each block's wgmma
to finish before promoting it (WARPGROUP.DEPBAR, then the FFMAs), so tensor cores idle during the
promotion: the expected limit against cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import act_quant, e8m0_to_f32, quantize_rows, round_bf16
from dsaserve.kernels.env import INTERPRET, num_sms
from dsaserve.kernels.quant import FP8_BLOCK


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per program (>= 16: tl.dot's minimum)
    block_n: int  # output columns (weight rows) per program
    split_k: int  # programs along K; > 1 adds a reduction kernel
    group_m: int  # M tiles per launch-order group (L2 reuse in prefill)
    fuse_quant: bool  # quantize bf16 activations inside the GEMM instead of act_quant first
    num_warps: int
    num_stages: int


def default_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Shape-only choice (no data read), so a captured graph keeps it."""
    sms = num_sms(device)
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        # wide stripes when N is large: fewer re-reads of the activation rows per weight byte
        block_n = 128 if n >= 16384 else 64
        tiles = triton.cdiv(n, block_n)
        split = 1
        if tiles < sms:  # too few stripes to fill the GPU: split K
            # ~4 programs per SM keep enough weight bytes in flight; >= 2 K blocks per split;
            # the fp32 partials (written and read back through L2) at most half the weight bytes
            split = max(1, min(triton.cdiv(4 * sms, tiles), k // FP8_BLOCK // 2, k // (8 * m)))
        # quantizing inside saves act_quant's launch, but every N stripe redoes it: worth it for
        # a handful of rows; at 64 rows it would cost more ALU per weight byte than the GEMM
        return GemmConfig(block_m, block_n, split, 1, block_m == 16, 4, 4)
    if m <= 512:
        return GemmConfig(64, 128, 1, 8, False, 4, 4)
    return GemmConfig(128, 128, 1, 8, False, 8, 4)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr,
    M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_cs, stride_cm,
    blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    FUSE_QUANT: tl.constexpr, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    # grouped launch order: GROUP_M row tiles share each weight stripe while it sits in L2
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    kb0 = tl.program_id(1) * blocks_per_split
    kb1 = tl.minimum(kb0 + blocks_per_split, K // 128)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    row_ok = rows < M
    col_ok = cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, 128]
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, 128]
    ws_row = ws_ptr + (cols // 128) * stride_wsn  # [BN]: the weight block row of each column

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb0, kb1):
        if FUSE_QUANT:  # bf16 rows -> e4m3 + one power-of-two scale per row, as act_quant
            x = tl.load(a_rows + kb * 128, mask=row_ok[:, None], other=0.0).to(tl.float32)
            a, _, sa, _ = quantize_rows(x, INTERP)
        else:
            a = tl.load(a_rows + kb * 128, mask=row_ok[:, None], other=0.0)
            sa = e8m0_to_f32(tl.load(as_ptr + rows * stride_asm + kb, mask=row_ok, other=127))
            if INTERP:
                a = a.to(tl.float32)
        w = tl.load(w_rows + kb * 128, mask=col_ok[:, None], other=0.0)
        sw = e8m0_to_f32(tl.load(ws_row + kb, mask=col_ok, other=127))  # [BN]
        if INTERP:
            w = w.to(tl.float32)
        part = tl.dot(a, tl.trans(w), input_precision="ieee" if INTERP else "tf32")
        acc += part * (sa[:, None] * sw[None, :])  # both powers of two: the product is exact

    c_ptrs = (
        c_ptr
        + tl.program_id(1).to(tl.int64) * stride_cs
        + rows[:, None].to(tl.int64) * stride_cm
        + cols[None, :]
    )
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        if INTERP and OUT_BF16:  # the interpreter's bf16 cast truncates: round on the bits
            acc = round_bf16(acc, True)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(
    p_ptr, c_ptr, total, splits, stride_ps, BLOCK: tl.constexpr, ROUND: tl.constexpr
):
    """c[i] = sum over splits (in order, fp32) of p[s, i], cast to c's dtype; flat indices."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    parts = p_ptr + offs
    for _ in range(splits):
        acc += tl.load(parts, mask=ok, other=0.0)
        parts += stride_ps  # (pointer arithmetic: 64-bit)
    if ROUND:  # interpreter, bf16 out: see _fp8_gemm_kernel
        acc = round_bf16(acc, True)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def check_weight(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Validate an FP8 weight and its block scales (no data read); return (N, K)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"FP8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if k % FP8_BLOCK != 0:
        raise ValueError(
            f"FP8 weight: in_features {k} is not a multiple of {FP8_BLOCK} (the "
            "release quantizes activations per 128 and asserts it)"
        )
    want = (triton.cdiv(n, FP8_BLOCK), k // FP8_BLOCK)
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 weight scale must be float8_e8m0fnu {want} for weight {n}x{k}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError("FP8 weight must be contiguous along in_features")
    return n, k


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    cfg: GemmConfig,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)  # [M, N]
    if m == 0:
        return out
    k_blocks = k // FP8_BLOCK
    per_split = triton.cdiv(k_blocks, max(1, min(cfg.split_k, k_blocks)))
    splits = triton.cdiv(k_blocks, per_split)  # no empty split
    ws = scale.view(torch.uint8)
    if ws.stride(1) != 1:
        ws = ws.contiguous()
    xs = ws if a_scale is None else a_scale.view(torch.uint8)  # unused when quantizing inside
    dst = (
        out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    )  # [S, M, N] partials
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _fp8_gemm_kernel[grid](
        a, xs, weight, ws, dst, m, n, k,
        a.stride(0), xs.stride(0), weight.stride(0), ws.stride(0),
        dst.stride(0) if splits > 1 else 0,
        n, per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, FUSE_QUANT=a_scale is None,
        SPLIT=splits > 1, OUT_BF16=out_dtype == torch.bfloat16, INTERP=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        round_out = INTERPRET and out_dtype == torch.bfloat16
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            dst, out, m * n, splits, dst.stride(0), BLOCK=block, ROUND=round_out, num_warps=4
        )
    return out


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """xq [M, K] float8_e4m3fn with x_scale [M, K/128] e8m0 (act_quant's output) times
    weight^T -> [M, N] out_dtype. config.fuse_quant is ignored (the input is quantized)."""
    n, k = check_weight(weight, scale)
    if xq.dtype != torch.float8_e4m3fn or xq.dim() != 2 or xq.shape[1] != k:
        raise ValueError(f"xq must be float8_e4m3fn [M, {k}], got {xq.dtype} {tuple(xq.shape)}")
    if tuple(x_scale.shape) != (xq.shape[0], k // FP8_BLOCK):
        raise ValueError(f"x_scale {tuple(x_scale.shape)} for xq {tuple(xq.shape)}")
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    x_scale = x_scale if x_scale.stride(1) == 1 else x_scale.contiguous()
    cfg = config or default_config(xq.shape[0], n, k, xq.device)
    return _launch(xq, x_scale, weight, scale, cfg, out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The release's linear() on an FP8 weight: x [..., K] bf16 (fp16/fp32 accepted) ->
    [..., N] out_dtype (bf16 in the release). Semantics: kernels.quant.fp8_linear_reference."""
    n, k = check_weight(weight, scale)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} vs FP8 weight {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    cfg = config or default_config(x2.shape[0], n, k, x.device)
    if cfg.fuse_quant:
        out = _launch(x2, None, weight, scale, cfg, out_dtype)
    else:
        xq, xs = act_quant(x2)
        out = _launch(xq, xs, weight, scale, cfg, out_dtype)
    return out.view(*x.shape[:-1], n)
