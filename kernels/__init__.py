"""DeepSeek sparse-attention kernels: sparse-MLA decode and the lightning-indexer top-k.

Public API (imports torch and triton only):

    out, lse = sparse_mla_decode(q, kv, indices, sm_scale, *, d_v=512, sinks=None, lengths=None)
    idx = indexer_topk(q, weights, k_cache, page_table, lengths, topk, *, scale)
    slots = positions_to_slots(positions, page_table, page_size)
    pre, post, comb = hc_weights(mixes, base, scale, n, iters, eps)      # mHC stream mixing
    y = rms_norm(x, weight_or_None, eps); y = apply_rope(x, cos, sin, inverse=False)

Dispatch: CUDA tensors run the Triton kernels (kernels.sparse_mla, kernels.indexer, kernels.mhc,
kernels.rowwise: no host sync, shape-only allocations, so decode steps can be captured in CUDA
graphs); CPU tensors run the plain-torch references (kernels.reference, exact in fp32). Force a
backend with

    with kernels.use_backend("triton"):      # or "reference", "naive"
        out, lse = kernels.sparse_mla_decode(...)

Without CUDA, "triton" runs in Triton's interpreter (kernels.env sets TRITON_INTERPRET=1 when
this package is imported first). ``kernels.naive`` holds the "before" kernels for benchmarks.
"""

from kernels import env  # noqa: F401, I001  (must precede the kernel modules: picks interpreter mode)
from kernels import naive, reference
from kernels.dispatch import (
    apply_rope,
    hc_weights,
    indexer_topk,
    rms_norm,
    sparse_mla_decode,
    use_backend,
)
from kernels.paging import positions_to_slots

__all__ = [
    "apply_rope",
    "hc_weights",
    "indexer_topk",
    "naive",
    "positions_to_slots",
    "reference",
    "rms_norm",
    "sparse_mla_decode",
    "use_backend",
]
