"""FP4 codes in shared memory -> the register A operand of Hopper's ``warpgroup_mma`` (Gluon),
for kernels.hopper.fp4_gemm; one 64-row half of a tile (a warpgroup) a call.

Three decodes (``DECODES``):
- "table": ``gl.fp4_to_fp`` (a byte-permute lookup) then a bf16 multiply by the 32-group's
  ue8m0 scale (bf16 x power of two: exact); any scale.
- "shift": inline PTX, per 32-bit word of 8 codes: each pair of codes (n_o, n_o+4) is shifted
  into a bf16x2 whose value is 2^-126 times the e2m1 pair (e2m1's subnormal 0.5 lands on bf16's
  subnormals), then one bf16x2 multiply by 2^(s - 1). About 30% fewer instructions; the
  multiplier must be a bf16, so every weight scale byte must be <= 128 (scales <= 2): true of
  the release's weights, checked where they are loaded (``kernels.quant.narrow_fp4_scales``).
- "fp8": the e4m3 codes of 2^-6 * e2m1 (kernels.act_quant.fp4_to_e4m3: 8 codes in 9
  instructions), one K=32 FP8 MMA per 32-group into a fresh accumulator, and the weight and
  activation scales applied to it, as the release's fp4_gemm promotes per group; any scale. Its
  B operand is the activations' e4m3 codes. The tensor cores' FP8 sums inside a group are not
  fp32-exact (as the release's own kernel on Hopper): rel. error ~2e-3 where the bf16 decodes
  give ~2e-4 (bench/NOTES-hopper.md).
The bf16 decodes multiply exact products into fp32 sums, as the release; only the order of
fp32 additions differs.

K order inside each 32-group: the register layout that lets a thread read 4 packed bytes at
once and give the decoded values to the MMA without moving data between threads puts input k
at another MMA position (``mma_columns``: a permutation of the 32 positions of a group, so the
scale group of a value never changes); the activations are written in that order
(``mma_order_block``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from dsaserve.kernels.act_quant import FP4_TO_E4M3_ASM

DECODES = ("table", "shift", "fp8")


def mma_columns(k: int, decode: str) -> torch.Tensor:
    """[k]: the input index whose value sits at each MMA column (K position) of a decode."""
    c = torch.arange(k)
    base, b0, d1, d3 = c & ~31, c & 1, (c >> 1) & 3, (c >> 3) & 3
    if decode == "table":  # c = b0 + 2 d1 + 8 d3 holds input b0 + 8 d1 + 2 d3
        return base | b0 | (d1 << 3) | (d3 << 1)
    if decode == "shift":  # c = e + 2 t + 8 o holds code o + 4 e of word t: input 8 t + 4 e + o
        return base | (d1 << 3) | (b0 << 2) | d3
    # "fp8": c = b + 4 t + 16 h holds nibble h of byte b of word t: input 8 t + 2 b + h
    return base | (((c >> 2) & 3) << 3) | ((c & 3) << 1) | ((c >> 4) & 1)


def to_mma_order(x: torch.Tensor, decode: str) -> torch.Tensor:
    """[..., K] in input order -> MMA column order (as the kernels write activations)."""
    return x[..., mma_columns(x.shape[-1], decode).to(x.device)]


@triton.jit
def mma_order_block(x, BM: tl.constexpr, DECODE: tl.constexpr):
    """[BM, 128] values in input order -> the same in MMA column order (mma_columns)."""
    if DECODE == 0:  # digits (group, d3, d1, b0) of the input index -> (group, d1, d3, b0)
        y = tl.permute(tl.reshape(x, [BM, 4, 4, 4, 2]), (0, 1, 3, 2, 4))
    elif DECODE == 1:  # input (group, t, e, o) -> column (group, o, t, e)
        y = tl.permute(tl.reshape(x, [BM, 4, 4, 2, 4]), (0, 1, 4, 2, 3))
    else:  # input (group, t, b, h) -> column (group, h, t, b)
        y = tl.permute(tl.reshape(x, [BM, 4, 4, 4, 2]), (0, 1, 4, 2, 3))
    return tl.reshape(y, [BM, 128])


@gluon.constexpr_function
def _packed_layout():
    """[64 rows, 128 bytes] of packed e2m1 (one SUB_K step of a warpgroup's half): a thread
    holds 4 consecutive bytes (one 32-bit shared load) of words w = 4m + t, t = lane % 4, for
    rows g and g + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [0, 64], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 128],
    )


@gluon.constexpr_function
def _group_layout():
    """Decoded values [64 rows, 8 groups, 32 k] as fp4_to_fp lays them out from _packed_layout:
    k = nibble + 2 * byte + 8 * t within a group."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0], [8, 0, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 8, 32],
    )


@gluon.constexpr_function
def _word_layout():
    """The same bytes as [64 rows, 8 groups, 4 words (t), 2 halves] of int16: a word's two
    halves in one register."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
        block_bases=[],
        shape=[64, 8, 4, 2],
    )


@gluon.jit
def decode_table(w_tile, s_tile, A_LAYOUT: gl.constexpr):
    """Shared [64, 128] packed bytes, [64, 8] scale bytes -> A [64, 256] bf16 in MMA order."""
    sb = s_tile.load(gl.SliceLayout(2, _group_layout())).to(gl.int16)
    bits = gl.where(sb == 0, 0x40, sb << 7)  # 2^(b - 127) as bf16; byte 0 is 2^-127
    scale = gl.where(sb == 255, 0x7FC0, bits).to(gl.bfloat16, bitcast=True)
    w = gl.fp4_to_fp(w_tile.load(_packed_layout()), gl.bfloat16, axis=1)  # [64, 256] input order
    w = gl.convert_layout(gl.reshape(w, [64, 8, 32]), _group_layout(), assert_trivial=True)
    w = w * gl.expand_dims(scale, 2)
    w = gl.reshape(gl.permute(gl.reshape(w, [64, 8, 4, 4, 2]), (0, 1, 3, 2, 4)), [64, 256])
    return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)


@gluon.jit
def decode_shift(w_tile, s_tile, A_LAYOUT: gl.constexpr):
    """As decode_table with the "shift" decode (scale bytes <= 128)."""
    L4: gl.constexpr = _word_layout()
    sb = s_tile.load(gl.SliceLayout(2, gl.SliceLayout(3, L4))).to(gl.int16)  # [64, 8]
    mult = (sb + 126) << 7  # bf16 2^(b - 1): undoes the decode's 2^-126
    mult = gl.expand_dims(gl.expand_dims(mult, 2), 3)  # [64, 8, 1, 1]
    as16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    words = w_tile._reinterpret(gl.int16, [64, 64], as16).load(
        gl.DistributedLinearLayout(  # the [64, 8, 4, 2] word layout, flattened
            reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [8, 0]],
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 64],
        )
    )
    words = gl.convert_layout(gl.reshape(words, [64, 8, 4, 2]), L4, assert_trivial=True)
    words, mult = gl.broadcast(words, mult)
    # out_o = codes (o, o + 4) of the word as bf16x2, times the scale
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 q, t, u;
        shl.b32 q, $4, 12;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $0, t, $5;
        shl.b32 q, $4, 8;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $1, t, $5;
        shl.b32 q, $4, 4;
        and.b32 t, q, 0x80008000;
        shr.b32 u, q, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $2, t, $5;
        and.b32 t, $4, 0x80008000;
        shr.b32 u, $4, 6;
        and.b32 u, u, 0x01C001C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $3, t, $5;
        }
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[words, mult],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=2,
    )
    # [64, 8 (group), 4 (t), 2 (e), 2 (i), 2 (j)], o = i + 2 j -> columns e + 2 t + 8 o + 32 group
    w = gl.join(gl.join(o0, o1), gl.join(o2, o3))
    w = gl.permute(w, (0, 1, 5, 4, 2, 3))
    return gl.convert_layout(gl.reshape(w, [64, 256]), A_LAYOUT, assert_trivial=True)


@gluon.constexpr_function
def _group_bytes_layout():
    """[64 rows, 16 bytes]: one 32-group of a warpgroup's half; thread t holds word t (bytes
    4t .. 4t + 3) of rows g and g + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 16],
    )


@gluon.jit
def _decode_fp8(w_group, A_LAYOUT: gl.constexpr):
    """Shared [64, 16] packed bytes (one 32-group) -> A [64, 32]: e4m3 codes of 2^-6 * e2m1
    (kernels.act_quant.fp4_to_e4m3) in MMA order; the scales come after the MMA."""
    lo, hi = gl.inline_asm_elementwise(
        asm=FP4_TO_E4M3_ASM,
        constraints="=r,=r,r",
        args=[w_group.load(_group_bytes_layout())],
        dtype=(gl.uint8, gl.uint8),
        is_pure=True,
        pack=4,
    )
    # [64, 16 (byte 4 t + b), 2 (h)] holds input 8 t + 2 b + h -> column b + 4 t + 16 h
    w = gl.permute(gl.reshape(gl.join(lo, hi), [64, 4, 4, 2]), (0, 3, 1, 2))
    w = gl.reshape(w, [64, 32]).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)


@gluon.constexpr_function
def _row_layout():
    """[64, 1] bytes: the scale of each MMA row (a thread's rows g and g + 8)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 1],
    )


@gluon.constexpr_function
def col_layout(bt):
    """[BT, 1] fp32: the scale of each MMA column (a thread's columns 2 t, 2 t + 1, + 8 j)."""
    regs = [[1, 0]] + [[8 << j, 0] for j in range(bt.bit_length() - 4)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[bt, 1],
    )


@gluon.jit
def _row_scales(ws_tile, m, ROWS: gl.constexpr):
    """The MMA rows' weight scales of 32-group m: fp32 2^(b - 127) of shared bytes [64, 8], as
    torch decodes them (byte 0 is 2^-127, 255 is NaN)."""
    b = ws_tile.slice(m, 1, dim=1).load(_row_layout()).to(gl.int32)
    bits = gl.where(b == 255, 0x7FC00000, gl.where(b == 0, 0x400000, b << 23))
    return gl.convert_layout(gl.reshape(bits, [64]), ROWS).to(gl.float32, bitcast=True)


@gluon.jit
def fp8_substep(acc, w_tile, x_tile, ws_tile, as0, as1, MMA: gl.constexpr):
    """One SUB_K step of the "fp8" decode: per 32-group, a fresh K=32 MMA of the codes, then
    acc += it x weight scale (row) x activation scale (column), as the release's fp4_gemm
    promotes; the next group decodes while an MMA runs (ptxas keeps the 8-bit A registers of
    an MMA in flight: they cannot be wait deps). ws_tile: shared [64, 8] scale bytes; as0, as1:
    the columns' activation scales of the step's two 128-blocks (2^6 folded in)."""
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    zero = gl.zeros(acc.shape, gl.float32, MMA)
    a = _decode_fp8(w_tile.slice(0, 16, dim=1), A_LAYOUT)
    pending = warpgroup_mma(a, x_tile.slice(0, 32, dim=1).permute((1, 0)), zero,
                            use_acc=False, is_async=True)  # fmt: skip
    ws = _row_scales(ws_tile, 0, ROWS)
    for m in gl.static_range(1, 8):
        a = _decode_fp8(w_tile.slice(16 * m, 16, dim=1), A_LAYOUT)
        p = warpgroup_mma(a, x_tile.slice(32 * m, 32, dim=1).permute((1, 0)), zero,
                          use_acc=False, is_async=True)  # fmt: skip
        done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))  # group m - 1's
        acc = acc + done * (ws[:, None] * (as0 if m <= 4 else as1)[None, :])
        ws = _row_scales(ws_tile, m, ROWS)
        pending = p
    done = warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
    return acc + done * (ws[:, None] * as1[None, :])
