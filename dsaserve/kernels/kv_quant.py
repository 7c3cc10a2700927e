"""FP8 KV cache (``--kv-cache-dtype fp8``): the paged byte formats of DeepSeek-V4's attention
entries, DeepSeek-V3.2's latent rows and both models' index keys, their exact torch definition,
the Triton quantize-on-write kernels, and the jitted tile loaders the decode and indexer kernels
dequantize with. Which attention format a pool holds follows from its rows' width: 512 values
(448 NoPE + 64 RoPE) are V4's, 576 (512 latent + 64 RoPE) V3.2's.

Attention entries (FlashMLA's "MODEL1" layout, vLLM's ``fp8_ds_mla`` for V4), 584 bytes a token.
A pool is uint8 [num_pages, >= P * 584]; page p holds the slots p*P .. p*P+P-1:

    bytes [0, P*576)       token t at t*576: 448 e4m3 codes (NoPE values 0..447), then the 64
                           RoPE values 448..511 as bf16, little-endian (128 bytes)
    bytes [P*576, P*584)   token t at P*576 + t*8: 7 ue8m0 scales, byte i for values
                           64i .. 64i+63, then 1 pad byte (written 0)

    value[c] = e4m3(code[c]) * 2^(scale_byte[c // 64] - 127)    (c < 448; exact in bf16)

So a token's 584 bytes are NOT contiguous: its scales sit with the other tokens' scales at the
end of the page. Quantization is the release's act_quant with 64-value groups: amax = max |x|
over the group (fp32), floored at 1e-4; scale = 2^ceil(log2(amax * fp32(1/448))) with the ceil
read off the fp32 bits; code = e4m3(clamp(x / scale, +-448)), nearest even. The dequantized row
is exactly what the model was trained on: the release runs every KV row through this FP8
round trip (in bf16) before attention, so FP8 attention = bf16 attention on dequantize(pool).

DeepSeek-V3.2's latent rows (FlashMLA's V3.2 layout, vLLM's ``fp8_ds_mla`` for V3.2), 656 bytes
a token, each token's bytes contiguous (a pool is uint8 [num_pages, P * 656], token t of a page
at t*656):

    bytes [0, 512)         512 e4m3 codes of the latent (values 0..511)
    bytes [512, 528)       4 fp32 scales, scale i for values 128i .. 128i+127 (little-endian)
    bytes [528, 656)       the 64 RoPE values 512..575 as bf16

    value[c] = e4m3(code[c]) * scale[c // 128]    (c < 512; scale a power of two, stored fp32)

with the same act_quant rounding over 128-value groups (amax floored at 1e-4, scale =
2^ceil(log2(amax * fp32(1/448))), codes nearest even). K = the whole dequantized row, V = its
first 512 values.

Index keys (CSA layers of V4, every V3.2 layer; vLLM's FP8 indexer cache, DeepGEMM's
paged-logits layout), Di + 4 bytes a token (132 for Di = 128). A pool is uint8
[num_pages, >= P * (Di + 4)]:

    bytes [0, P*Di)        token t at t*Di: Di e4m3 codes
    bytes [P*Di, P*(Di+4)) token t at P*Di + 4t: its fp32 scale, little-endian

    key[c] = e4m3(code[c]) * scale,  scale = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))

one power-of-two scale per token over all Di values (the same act_quant rounding, one group of
Di). A power of two commutes exactly with fp32 rounding, so kernels may multiply the per-token
score by the scale after the dot product and the ReLU-weighted head sum.

Where each fact was read (never inferred):
- 448 + 64*2 + 7 + 1 = 584 bytes, 7 tiles of 64, d_qk 512: FlashMLA csrc/api/sparse_decode.h
  ("MODEL1 style" bytes_per_token) and tests/quant.py (FP8KVCacheLayout.MODEL1_FP8Sparse).
- Placement inside a page: FlashMLA tests/quant.py (quantize_k_cache, MODEL1 branch: the
  [block, 576] nope+rope part first, then ``view(num_blocks, block_size, 8)[:, :, :7]`` scales)
  and csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh (scales at block base +
  page_block_size * (448 + 2*64) + token * 8, read as one 8-byte load; RoPE right after the
  448 codes; the page stride is the tensor's stride(0)); vLLM
  vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py (the V4 writer's docstring
  "[0, bs*576): token data (448 fp8 + 128 bf16 each); [bs*576, +bs*8): uint8 UE8M0 scales
  (7 real + 1 pad each)", pad stored as 0). FlashMLA's test pads each page to a multiple of 576
  bytes; its kernels read the page stride from the tensor, so pages here are P*584 bytes unless
  the caller hands in a wider (sliced) tensor.
- Scale rounding: the release's inference/model.py (``act_quant(kv[..., :-rd], 64, scale_fmt,
  scale_dtype, True)`` in Attention.forward and Compressor.forward, scale_fmt "ue8m0") and
  inference/kernel.py (act_quant_kernel: amax floor 1e-4, fast_round_scale), read in the mirror
  GitHub supermy/ds4rs. vLLM's V4 writer agrees (floor 1e-4 on amax, ceil(log2(amax/448)), RNE
  cast, byte = exponent + 127) except that it takes the log2 in float arithmetic, which can round
  down when amax/448 lies within an ulp or two above a power of two. FlashMLA's tests/quant.py
  floors amax/448 (not amax) at 1e-4: a test helper, not the trained numerics; it only differs
  for groups with amax < 0.0448.
- V3.2 rows: FlashMLA csrc/api/sparse_decode.h (656 bytes a token for d_qk 576) and its
  tests/quant.py (V3.2 branch: [512 fp8 | 4 fp32 scales | 64 bf16], one 128-value tile a scale,
  scales rounded up to powers of two); a PyTorch transcription of FlashMLA's packing kernel
  ("[0:512] FP8 E4M3FN latent, [512:528] float32 scales, [528:656] BF16 rope", pow2_ceil(amax /
  448), amax clamped at 1e-4); vLLM's ``fp8_ds_mla`` cache shape (num_blocks, block_size, 656).
- Index keys: vLLM fused_compress_quant_cache.py ``_fused_kv_compress_norm_rope_insert_indexer_
  attn`` (layout "[0, bs*128): FP8 data; [bs*128, +bs*4): float32 scales", one 128-value block,
  scale exp2(ceil(log2(max(amax, 1e-4) / 448))) stored as fp32); DeepGEMM tests
  ``kv_cache_cast_to_fp8`` (same page layout; there the scale is amax/448, unrounded).
  The release itself trains the indexer with FP4 (Hadamard rotation + fp4_act_quant, 32-value
  blocks) instead; FP8 keys are vLLM's non-MXFP4 serving format, not the release's round trip.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dsaserve.kernels.act_quant import e8m0_to_f32, quantize_rows, round_bf16
from dsaserve.kernels.env import INTERPRET
from dsaserve.kernels.quant import act_quant_reference, ue8m0_to_float

KV_DIM = 512  # values per attention entry (K = V)
KV_NOPE = 448  # e4m3 values
KV_ROPE = 64  # bf16 values
KV_GROUP = 64  # values per ue8m0 scale
KV_GROUPS = KV_NOPE // KV_GROUP  # 7
KV_DATA_BYTES = KV_NOPE + 2 * KV_ROPE  # 576 per token, first part of a page
KV_SCALE_BYTES = KV_GROUPS + 1  # 8 per token (7 scales + pad), second part of a page
KV_TOKEN_BYTES = KV_DATA_BYTES + KV_SCALE_BYTES  # 584
INDEX_SCALE_BYTES = 4  # one fp32 per token
V32_DIM = 576  # values per V3.2 latent row: 512 e4m3 + 64 bf16 RoPE
V32_NOPE = 512
V32_GROUP = 128  # values per fp32 scale
V32_GROUPS = V32_NOPE // V32_GROUP  # 4
V32_SCALES_AT = V32_NOPE  # byte offsets inside a token's 656 bytes
V32_ROPE_AT = V32_SCALES_AT + 4 * V32_GROUPS  # 528
V32_TOKEN_BYTES = V32_ROPE_AT + 2 * KV_ROPE  # 656
# the read tile is [BLOCK_N, 8, 64]: 7 NoPE groups, then the RoPE values as the 8th group
assert KV_ROPE == KV_GROUP

# in-kernel copies: jit functions may only read constexpr globals
_NOPE = tl.constexpr(KV_NOPE)
_GROUP = tl.constexpr(KV_GROUP)
_GROUPS = tl.constexpr(KV_GROUPS)
_DATA = tl.constexpr(KV_DATA_BYTES)
_SCALES = tl.constexpr(KV_SCALE_BYTES)
_V32_NOPE = tl.constexpr(V32_NOPE)
_V32_GROUP = tl.constexpr(V32_GROUP)
_V32_GROUPS = tl.constexpr(V32_GROUPS)
_V32_SCALES_AT = tl.constexpr(V32_SCALES_AT)
_V32_ROPE_AT = tl.constexpr(V32_ROPE_AT)
_V32_TOKEN = tl.constexpr(V32_TOKEN_BYTES)
_ROPE = tl.constexpr(KV_ROPE)


def index_token_bytes(head_dim: int) -> int:
    return head_dim + INDEX_SCALE_BYTES


def kv_token_bytes(dim: int) -> int:
    """Bytes an FP8 attention row of `dim` values takes: 584 (V4's 512) or 656 (V3.2's 576)."""
    formats = {KV_DIM: KV_TOKEN_BYTES, V32_DIM: V32_TOKEN_BYTES}
    if dim not in formats:
        raise ValueError(f"no FP8 format for {dim}-wide KV rows (only {sorted(formats)})")
    return formats[dim]


# ---- pools ---------------------------------------------------------------------------------


def kv_pool(num_pages: int, page_size: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed attention pool, uint8 [num_pages, page_size * 584] (zero bytes read as 0.0);
    page_size even, so pages stay 16-byte aligned."""
    return torch.zeros(num_pages, page_size * KV_TOKEN_BYTES, dtype=torch.uint8, device=device)


def index_pool(
    num_pages: int, page_size: int, head_dim: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed index-key pool, uint8 [num_pages, page_size * (head_dim + 4)]; page_size a
    multiple of 4 (Di = 128), so pages stay 16-byte aligned."""
    return torch.zeros(
        num_pages, page_size * index_token_bytes(head_dim), dtype=torch.uint8, device=device
    )


def _page_size(pool: torch.Tensor, token_bytes: int) -> int:
    assert pool.dtype == torch.uint8 and pool.dim() == 2, f"{pool.dtype} {tuple(pool.shape)}"
    assert pool.stride(1) == 1, "the bytes of a page must be contiguous"
    assert pool.shape[1] % token_bytes == 0, f"{pool.shape[1]} bytes a page, {token_bytes} a token"
    # the kernels load scales as 4- and 8-byte words and rows 16 bytes at a time
    assert pool.stride(0) % 16 == 0 and pool.data_ptr() % 16 == 0, "pages must be 16-byte aligned"
    return pool.shape[1] // token_bytes


def kv_page_size(pool: torch.Tensor, dim: int = KV_DIM) -> int:
    """Tokens a page of an attention pool of `dim`-wide rows holds (its width / 584 or 656)."""
    return _page_size(pool, kv_token_bytes(dim))


def index_page_size(pool: torch.Tensor, head_dim: int) -> int:
    """Tokens a page of an index-key pool holds (its width / (head_dim + 4))."""
    return _page_size(pool, index_token_bytes(head_dim))


def keys_per_page(k_cache: torch.Tensor, head_dim: int) -> int:
    """P of an indexer key cache: plain [pages, P, Di] or an FP8 pool [pages, P * (Di + 4)]."""
    return index_page_size(k_cache, head_dim) if k_cache.dtype == torch.uint8 else k_cache.shape[1]


def kv_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an attention pool: (token data [pages, P, 576], scale bytes [pages, P, 8])."""
    p = kv_page_size(pool)
    data = pool[:, : p * KV_DATA_BYTES].unflatten(1, (p, KV_DATA_BYTES))
    scales = pool[:, p * KV_DATA_BYTES : p * KV_TOKEN_BYTES].unflatten(1, (p, KV_SCALE_BYTES))
    return data, scales


def v32_views(pool: torch.Tensor) -> torch.Tensor:
    """A V3.2 attention pool's tokens, uint8 [pages, P, 656]."""
    p = kv_page_size(pool, V32_DIM)
    return pool[:, : p * V32_TOKEN_BYTES].unflatten(1, (p, V32_TOKEN_BYTES))


def index_views(pool: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an index-key pool: (codes [pages, P, Di] uint8, scales [pages, P] fp32)."""
    p = index_page_size(pool, head_dim)
    codes = pool[:, : p * head_dim].unflatten(1, (p, head_dim))
    scales = pool[:, p * head_dim : p * index_token_bytes(head_dim)].view(torch.float32)
    return codes, scales


# ---- the formats, per token (exact torch definition) ---------------------------------------


def quantize_kv(kv: torch.Tensor) -> torch.Tensor:
    """kv [N, 512] (bf16; fp32 accepted) -> the tokens' 584 bytes, uint8 [N, 584]: the 576 data
    bytes (448 e4m3 codes, 64 bf16) then the 8 scale bytes (7 ue8m0, pad 0). Where these bytes go
    in a page: module docstring (store_kv_reference)."""
    assert kv.dim() == 2 and kv.shape[1] == KV_DIM, tuple(kv.shape)
    codes, scales = act_quant_reference(kv[:, :KV_NOPE], block=KV_GROUP)  # [N, 448], [N, 7]
    rope = kv[:, KV_NOPE:].to(torch.bfloat16).contiguous()  # [N, 64]
    out = torch.zeros(kv.shape[0], KV_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :KV_NOPE] = codes.view(torch.uint8)
    out[:, KV_NOPE:KV_DATA_BYTES] = rope.view(torch.uint8)
    out[:, KV_DATA_BYTES : KV_DATA_BYTES + KV_GROUPS] = scales.view(torch.uint8)
    return out


def dequantize_kv(records: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 584] (quantize_kv's token bytes) -> fp32 [..., 512], exact."""
    codes = records[..., :KV_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scales = ue8m0_to_float(records[..., KV_DATA_BYTES : KV_DATA_BYTES + KV_GROUPS].contiguous())
    nope = (codes.unflatten(-1, (KV_GROUPS, KV_GROUP)) * scales[..., None]).flatten(-2)
    rope = records[..., KV_NOPE:KV_DATA_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1)


def quantize_kv_v32(kv: torch.Tensor) -> torch.Tensor:
    """V3.2 rows kv [N, 576] (bf16; fp32 accepted) -> their 656 bytes, uint8 [N, 656]: 512 e4m3
    codes, 4 fp32 power-of-two scales (one per 128 values), 64 bf16 RoPE values."""
    assert kv.dim() == 2 and kv.shape[1] == V32_DIM, tuple(kv.shape)
    codes, scales = act_quant_reference(kv[:, :V32_NOPE], block=V32_GROUP)  # [N, 512], [N, 4]
    out = torch.empty(kv.shape[0], V32_TOKEN_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :V32_NOPE] = codes.view(torch.uint8)
    out[:, V32_SCALES_AT:V32_ROPE_AT] = ue8m0_to_float(scales).view(torch.uint8)
    out[:, V32_ROPE_AT:] = kv[:, V32_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_kv_v32(records: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] (quantize_kv_v32's bytes) -> fp32 [..., 576], exact."""
    codes = records[..., :V32_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scales = records[..., V32_SCALES_AT:V32_ROPE_AT].contiguous().view(torch.float32)
    nope = (codes.unflatten(-1, (V32_GROUPS, V32_GROUP)) * scales[..., None]).flatten(-2)
    rope = records[..., V32_ROPE_AT:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1)


def quantize_index_k(k: torch.Tensor) -> torch.Tensor:
    """k [N, Di] (bf16; fp32 accepted) -> uint8 [N, Di + 4]: Di e4m3 codes, then the token's
    fp32 power-of-two scale (little-endian bytes)."""
    assert k.dim() == 2, tuple(k.shape)
    codes, scale = act_quant_reference(k, block=k.shape[1])  # [N, Di], [N, 1] e8m0
    out = torch.empty(k.shape[0], index_token_bytes(k.shape[1]), dtype=torch.uint8, device=k.device)
    out[:, : k.shape[1]] = codes.view(torch.uint8)
    out[:, k.shape[1] :] = ue8m0_to_float(scale).view(torch.uint8)
    return out


def dequantize_index_k(records: torch.Tensor) -> torch.Tensor:
    """uint8 [..., Di + 4] (quantize_index_k's bytes) -> fp32 [..., Di], exact."""
    head_dim = records.shape[-1] - INDEX_SCALE_BYTES
    codes = records[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    return codes * records[..., head_dim:].contiguous().view(torch.float32)


# ---- pools: write (reference) and gather -------------------------------------------------------


def _split_slots(slots: torch.Tensor, page_size: int, num_pages: int) -> tuple[torch.Tensor, ...]:
    slots = slots.long()
    ok = (slots >= 0) & (slots < num_pages * page_size)
    return ok, slots // page_size, slots % page_size


def store_kv_reference(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize kv [N, 512] into the slots [N] of an attention pool; slots outside
    [0, pages * P) are skipped. Semantics of kernels.dispatch.store_kv_fp8; synchronises."""
    data, scales = kv_views(pool)
    ok, page, off = _split_slots(slots, data.shape[1], data.shape[0])
    records = quantize_kv(kv[ok])
    data[page[ok], off[ok]] = records[:, :KV_DATA_BYTES]
    scales[page[ok], off[ok]] = records[:, KV_DATA_BYTES:]


def store_kv_v32_reference(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize V3.2 rows kv [N, 576] into the slots [N] of a V3.2 attention pool; slots outside
    [0, pages * P) are skipped. Semantics of kernels.dispatch.store_kv_fp8; synchronises."""
    tokens = v32_views(pool)
    ok, page, off = _split_slots(slots, tokens.shape[1], tokens.shape[0])
    tokens[page[ok], off[ok]] = quantize_kv_v32(kv[ok])


def store_index_k_reference(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Quantize keys k [N, Di] into the slots [N] of an index-key pool (others skipped)."""
    head_dim = k.shape[1]
    codes, scales = index_views(pool, head_dim)
    ok, page, off = _split_slots(slots, codes.shape[1], codes.shape[0])
    records = quantize_index_k(k[ok])
    codes[page[ok], off[ok]] = records[:, :head_dim]
    scales[page[ok], off[ok]] = records[:, head_dim:].contiguous().view(torch.float32)[:, 0]


def gather_kv(pool: torch.Tensor, slots: torch.Tensor, dim: int = KV_DIM) -> torch.Tensor:
    """Dequantized rows of an attention pool of `dim`-wide rows at slots (any shape, each in
    [0, pages * P)): fp32 [*slots.shape, dim]."""
    if dim == V32_DIM:
        tokens = v32_views(pool)
        return dequantize_kv_v32(
            tokens[slots.long() // tokens.shape[1], slots.long() % tokens.shape[1]]
        )
    data, scales = kv_views(pool)
    page, off = slots.long() // data.shape[1], slots.long() % data.shape[1]
    return dequantize_kv(torch.cat((data[page, off], scales[page, off]), dim=-1))


def gather_index_k(pool: torch.Tensor, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Dequantized keys of an index-key pool at slots (any shape, each valid): fp32
    [*slots.shape, Di]."""
    codes, scales = index_views(pool, head_dim)
    page, off = slots.long() // codes.shape[1], slots.long() % codes.shape[1]
    return codes[page, off].view(torch.float8_e4m3fn).float() * scales[page, off][..., None]


# ---- Triton: quantize on write -----------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    pool_ptr, slot_ptr, x_ptr,
    n_rows, stride_x, stride_page, num_slots,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)  # 0..6: one 64-value NoPE group; 7: the RoPE values and the pad
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    ok = (rows < n_rows) & (slot >= 0) & (slot < num_slots)
    base = pool_ptr + (slot // PAGE) * stride_page  # [BLOCK_M] page starts
    data = base + (slot % PAGE) * _DATA
    scale_byte = base + PAGE * _DATA + (slot % PAGE) * _SCALES + group
    offs = tl.arange(0, _GROUP)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_x + group * _GROUP + offs[None, :],
        mask=ok[:, None],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, 64]
    if group < _GROUPS:
        _, bits, _, sbyte = quantize_rows(x, INTERP)
        tl.store(data[:, None] + group * _GROUP + offs[None, :], bits, mask=ok[:, None])
        tl.store(scale_byte, sbyte, mask=ok)
    else:
        rope = (data + _NOPE).to(tl.pointer_type(tl.bfloat16))
        tl.store(
            rope[:, None] + offs[None, :], round_bf16(x, INTERP).to(tl.bfloat16), mask=ok[:, None]
        )
        tl.store(scale_byte, tl.zeros([BLOCK_M], tl.uint8), mask=ok)


@triton.jit
def _store_index_k_kernel(
    pool_ptr, slot_ptr, x_ptr,
    n_rows, stride_x, stride_page, num_slots,
    PAGE: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    ok = (rows < n_rows) & (slot >= 0) & (slot < num_slots)
    base = pool_ptr + (slot // PAGE) * stride_page
    dims = tl.arange(0, DIM)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_x + dims[None, :], mask=ok[:, None], other=0.0
    ).to(tl.float32)  # [BLOCK_M, DIM]
    _, bits, scale, _ = quantize_rows(x, INTERP)
    tl.store((base + (slot % PAGE) * DIM)[:, None] + dims[None, :], bits, mask=ok[:, None])
    scale_at = (base + PAGE * DIM + (slot % PAGE) * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_at, scale, mask=ok)


@triton.jit
def _store_kv_v32_kernel(
    pool_ptr, slot_ptr, x_ptr,
    n_rows, stride_x, stride_page, num_slots,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)  # 0..3: one 128-value latent group; 4: the RoPE values
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    ok = (rows < n_rows) & (slot >= 0) & (slot < num_slots)
    token = pool_ptr + (slot // PAGE) * stride_page + (slot % PAGE) * _V32_TOKEN  # [BLOCK_M]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    # each branch names its own tiles: compiled Triton wants a name to keep one type across branches
    if group < _V32_GROUPS:
        lat = tl.arange(0, _V32_GROUP)
        nope = tl.load(x_rows + group * _V32_GROUP + lat[None, :], mask=ok[:, None], other=0.0)
        _, bits, scale, _ = quantize_rows(nope.to(tl.float32), INTERP)
        tl.store(token[:, None] + group * _V32_GROUP + lat[None, :], bits, mask=ok[:, None])
        scale_at = (token + _V32_SCALES_AT + 4 * group).to(tl.pointer_type(tl.float32))
        tl.store(scale_at, scale, mask=ok)
    else:
        pos = tl.arange(0, _ROPE)
        rope = tl.load(x_rows + _V32_NOPE + pos[None, :], mask=ok[:, None], other=0.0)
        rope_at = (token + _V32_ROPE_AT).to(tl.pointer_type(tl.bfloat16))
        tl.store(
            rope_at[:, None] + pos[None, :],
            round_bf16(rope.to(tl.float32), INTERP).to(tl.bfloat16),
            mask=ok[:, None],
        )


def _check_store(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, dim: int) -> None:
    assert rows.dim() == 2 and rows.shape[1] == dim, f"rows {tuple(rows.shape)}, want [N, {dim}]"
    assert rows.dtype in (torch.bfloat16, torch.float16, torch.float32), rows.dtype
    assert slots.shape == (rows.shape[0],), f"slots {tuple(slots.shape)} for {rows.shape[0]} rows"
    assert slots.dtype in (torch.int32, torch.int64), slots.dtype
    assert pool.device == rows.device == slots.device


def store_kv(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Triton quantize-on-write of V4's rows; semantics in kernels.dispatch.store_kv_fp8."""
    _store_rows(_store_kv_kernel, KV_GROUPS + 1, pool, slots, kv, KV_DIM)


def store_kv_v32(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Triton quantize-on-write of V3.2 rows; semantics in kernels.dispatch.store_kv_fp8."""
    _store_rows(_store_kv_v32_kernel, V32_GROUPS + 1, pool, slots, kv, V32_DIM)


def _store_rows(
    kernel: Any, parts: int, pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, dim: int
) -> None:
    """Launch an attention-row store kernel: one program per 16-32 rows and part of a row."""
    page = kv_page_size(pool, dim)
    _check_store(pool, slots, kv, dim)
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    n = kv.shape[0]
    block_m = 16 if n <= 16 else 32
    if n > 0:
        kernel[(triton.cdiv(n, block_m), parts)](
            pool, slots, kv, n,
            kv.stride(0), pool.stride(0),
            pool.shape[0] * page,
            PAGE=page, BLOCK_M=block_m, INTERP=INTERPRET,
            num_warps=4,
        )  # fmt: skip


def store_index_k(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Triton quantize-on-write of index keys; semantics in kernels.dispatch.store_index_k_fp8."""
    head_dim = k.shape[1]
    page = index_page_size(pool, head_dim)
    _check_store(pool, slots, k, head_dim)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"Di = {head_dim}: a power of two"
    k = k if k.stride(1) == 1 else k.contiguous()
    n = k.shape[0]
    block_m = 16 if n <= 16 else 32
    if n > 0:
        _store_index_k_kernel[(triton.cdiv(n, block_m),)](
            pool, slots, k, n,
            k.stride(0), pool.stride(0),
            pool.shape[0] * page,
            PAGE=page, DIM=head_dim, BLOCK_M=block_m, INTERP=INTERPRET,
            num_warps=4,
        )  # fmt: skip


# ---- Triton: tile loaders of the read kernels ------------------------------------------------


@triton.jit
def load_kv_fp8(pool_ptr, slot, valid, stride_page, PAGE: tl.constexpr, OUT: tl.constexpr):
    """Attention entries at slot [BLOCK_N] (int32 slot ids) of an FP8 pool, dequantized: OUT
    [BLOCK_N, 512] (exact for bf16/fp16/fp32), rows where `valid` is false are 0. The NoPE
    values are loaded as [BLOCK_N, 8, 64] (group 7 = the RoPE columns, taken from the bf16 part)
    so each 64-value group meets its scale by broadcasting, then reshaped; a token's 7 scales
    (+ pad) are one 8-byte load."""
    base = pool_ptr + (slot // PAGE).to(tl.int64) * stride_page  # [BLOCK_N] page starts
    data = base + (slot % PAGE) * _DATA
    g = tl.arange(0, _GROUPS + 1)
    c = tl.arange(0, _GROUP)
    cols = g[:, None] * _GROUP + c[None, :]  # [8, 64]
    codes = tl.load(
        data[:, None, None] + cols[None, :, :],
        mask=valid[:, None, None] & (g < _GROUPS)[None, :, None],
        other=0,
    )  # [BLOCK_N, 8, 64] uint8
    rope = tl.load(
        (data + _NOPE).to(tl.pointer_type(tl.bfloat16))[:, None] + c[None, :],
        mask=valid[:, None],
        other=0.0,
    )  # [BLOCK_N, 64]
    words = tl.load(
        (base + PAGE * _DATA + (slot % PAGE) * _SCALES).to(tl.pointer_type(tl.int64)),
        mask=valid,
        other=0,
    )  # [BLOCK_N]: byte i = scale of group i (little-endian)
    scale = e8m0_to_f32((words[:, None] >> (8 * g).to(tl.int64)[None, :]) & 0xFF)  # [BLOCK_N, 8]
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    x = tl.where((g == _GROUPS)[None, :, None], rope.to(tl.float32)[:, None, :], x).to(OUT)
    return tl.reshape(x, (slot.shape[0], (_GROUPS + 1) * _GROUP))  # cast first: half the bytes


@triton.jit
def load_kv_v32_fp8(
    pool_ptr, slot, valid, stride_page, PAGE: tl.constexpr, OUT: tl.constexpr, ROPE: tl.constexpr
):  # fmt: skip
    """V3.2 rows at slot [BLOCK_N] (int32 slot ids) of an FP8 pool, dequantized to OUT (exact for
    bf16/fp16/fp32), 0 where `valid` is false: the latent part [BLOCK_N, 512] (loaded as
    [BLOCK_N, 4, 128] so each group meets its scale; a token's 4 fp32 scales are one 16-byte
    load), or with ROPE the RoPE part [BLOCK_N, 64]."""
    token = pool_ptr + (slot // PAGE).to(tl.int64) * stride_page + (slot % PAGE) * _V32_TOKEN
    # if/else, not an early return: compiled Triton checks every return against the first
    if ROPE:
        c = tl.arange(0, _ROPE)
        rope = (token + _V32_ROPE_AT).to(tl.pointer_type(tl.bfloat16))
        return tl.load(rope[:, None] + c[None, :], mask=valid[:, None], other=0.0).to(OUT)
    else:
        g = tl.arange(0, _V32_GROUPS)
        c = tl.arange(0, _V32_GROUP)
        cols = g[:, None] * _V32_GROUP + c[None, :]  # [4, 128]
        codes = tl.load(
            token[:, None, None] + cols[None, :, :], mask=valid[:, None, None], other=0
        )  # [BLOCK_N, 4, 128]
        scales = tl.load(
            (token + _V32_SCALES_AT).to(tl.pointer_type(tl.float32))[:, None] + g[None, :],
            mask=valid[:, None],
            other=0.0,
        )  # [BLOCK_N, 4]
        x = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales[:, :, None]).to(OUT)
        return tl.reshape(x, (slot.shape[0], _V32_NOPE))


@triton.jit
def load_index_k_fp8(
    pool_ptr, page, off, valid, stride_page, page_size, DIM: tl.constexpr, OUT: tl.constexpr
):
    """Keys at (page, offset) [BLOCK_N] of an FP8 index-key pool: (e4m3 codes as OUT
    [BLOCK_N, DIM] (tl.float8e4nv: the codes themselves, for an FP8 MMA), per-token fp32 scales
    [BLOCK_N]); both 0 where `valid` is false. The key is codes * scale; callers apply the scale
    to whatever is linear in the key."""
    base = pool_ptr + page.to(tl.int64) * stride_page
    dims = tl.arange(0, DIM)
    codes = tl.load((base + off * DIM)[:, None] + dims[None, :], mask=valid[:, None], other=0)
    scale_at = (base + page_size * DIM + off * 4).to(tl.pointer_type(tl.float32))
    scale = tl.load(scale_at, mask=valid, other=0.0)
    return codes.to(tl.float8e4nv, bitcast=True).to(OUT), scale
