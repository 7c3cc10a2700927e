"""DeepSeek sparse-attention kernels: sparse-MLA decode and the lightning-indexer top-k.

Public API (imports torch and triton only):

    out, lse = sparse_mla_decode(q, kv, indices, sm_scale, *, d_v=512, sinks=None, lengths=None)
    idx = indexer_topk(q, weights, k_cache, page_table, lengths, topk, *, scale)
    slots = positions_to_slots(positions, page_table, page_size)
    store_kv_fp8(pool, slots, kv); store_index_k_fp8(pool, slots, keys)  # FP8 KV, kernels.kv_quant
    store_rows(pool, slots, rows, page_size)              # a plain or either FP8 pool
    copy_rows(pool, src_slots, dst_slots, page_size)      # slot to slot, a plain or FP8 pool
    pre, post, comb = hc_weights(mixes, base, scale, n, iters, eps)      # mHC stream mixing
    y = rms_norm(x, weight_or_None, eps); y = apply_rope(x, cos, sin, inverse=False)
    xq, xs = quantize_activations(x)                      # FP8 per 128, ue8m0 scales
    y = fp8_linear(x, weight_fp8, scale_e8m0)             # the V4 release's FP8 linear()
    y = fp4_experts(x, expert_ids, weights, w13, s13, w2, s2, swiglu_limit)  # FP4 experts
    y = fp8_experts(x, expert_ids, weights, w13, s13, w2, s2)  # FP8 experts (V3.2)

Fused decode glue (kernels.fused_dispatch; one or two launches each where the engine runs 5-25):

    compress_decode(CompressorRows(kv, gate, positions, ...), target, trash_slot)  # CSA / HCA
    q, weights, lengths = indexer_query(q, weights, cos, sin, positions, rate)
    indices, lengths = sparse_indices(positions, row_req, req_past, req_row0, table, ...)
    streams, post, comb, x = hc_pre(streams, fn, base, scale, norm_weight, iters, hc_eps,
                                    norm_eps, merge=(out, post, comb) | None)
    streams = hc_merge(streams, out, post, comb)
    q, kv = attention_pre(q, kv, kv_weight, eps, cos, sin, cache, scratch_slots, ring_slots)
    out = attention_post(out, cos, sin)                      # inverse RoPE, in place

Dispatch: CUDA tensors run the Triton kernels (kernels.sparse_mla, kernels.indexer, kernels.mhc,
kernels.rowwise: no host sync, shape-only allocations, so decode steps can be captured in CUDA
graphs); CPU tensors run the plain-torch references (kernels.reference, exact in fp32). Force a
backend with

    with kernels.use_backend("triton"):      # or "reference"
        out, lse = kernels.sparse_mla_decode(...)

(kernels.backend: one rule for every kernel; `swap_kernels` is how bench/naive.py's "before"
kernels run inside the engine). Without CUDA, "triton" runs in Triton's interpreter
(kernels.env sets TRITON_INTERPRET=1 when this package is imported first).
The checkpoint formats (FP8 128x128 blocks, FP4 experts) and their exact torch definitions are in
``kernels.quant``; the quantized kernels in kernels.act_quant, kernels.fp8_gemm, kernels.fp4_moe.

Kernel signatures and launches are written as argument groups (pointers, strides, sizes,
constexprs, launch options), as Triton's tutorials write them; `# fmt: skip` on the closing
line keeps the formatter from putting every argument on a line of its own.
"""

from dsaserve.kernels import env  # noqa: F401, I001  (must precede the kernel modules: picks interpreter mode)
from dsaserve.kernels import kv_quant, quant, reference
from dsaserve.kernels.backend import swap_kernels, use_backend
from dsaserve.kernels.compressor_rows import CompressorRows
from dsaserve.kernels.dispatch import (
    apply_rope,
    copy_rows,
    hc_weights,
    indexer_topk,
    rms_norm,
    sparse_mla_decode,
    store_index_k_fp8,
    store_kv_fp8,
    store_rows,
)
from dsaserve.kernels.fp4_moe import stack_fp4_experts
from dsaserve.kernels.fused_dispatch import (
    attention_post,
    attention_pre,
    compress_decode,
    hc_merge,
    hc_pre,
    indexer_query,
    sparse_indices,
)
from dsaserve.kernels.paging import positions_to_slots
from dsaserve.kernels.fp8_moe import stack_fp8_experts
from dsaserve.kernels.quant_dispatch import (
    fp4_experts,
    fp8_experts,
    fp8_linear,
    quantize_activations,
)

__all__ = [
    "CompressorRows",
    "apply_rope",
    "attention_post",
    "attention_pre",
    "compress_decode",
    "copy_rows",
    "fp4_experts",
    "fp8_experts",
    "fp8_linear",
    "hc_merge",
    "hc_pre",
    "hc_weights",
    "indexer_query",
    "indexer_topk",
    "kv_quant",
    "positions_to_slots",
    "quant",
    "quantize_activations",
    "reference",
    "rms_norm",
    "sparse_indices",
    "sparse_mla_decode",
    "stack_fp4_experts",
    "stack_fp8_experts",
    "store_index_k_fp8",
    "store_kv_fp8",
    "store_rows",
    "swap_kernels",
    "use_backend",
]
