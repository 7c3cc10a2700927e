"""Online-softmax pieces shared by the sparse-MLA decode kernels (Triton, base-2 scores).

Scores arrive pre-multiplied by ``sm_scale * log2(e)`` so the kernels use ``exp2``; masked entries
are ``-inf``. A head that has seen no valid entry keeps ``m = -inf`` and ``l = 0``; the steps below
keep every intermediate finite in that case, so such a head ends with out = 0 and lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# in-kernel copies: jit functions may only read constexpr globals
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def softmax_step(s, m, l):
    """Fold a tile of scores s [BLOCK_H, BLOCK_N] into the running max m and sum l [BLOCK_H].

    Returns (p, alpha, m_new, l_new): p are the tile's weights against m_new, and alpha rescales
    what was accumulated against m."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # all-masked so far: subtract 0 instead of -inf, so exp2 gives 0 rather than nan
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def normalize(acc, m, l):
    """acc [BLOCK_H, D_V] / l, and the base-2 lse; a head with l = 0 gives 0 and -inf."""
    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    lse2 = tl.where(seen, m + tl.log2(l_safe), float("-inf"))
    return acc / l_safe[:, None], lse2


@triton.jit
def finalize(o, lse2, sink_ptr, heads, HAS_SINKS: tl.constexpr):
    """Apply the per-head sink to a normalised o [BLOCK_H, D_V]; return (out, natural lse).

    With a sink, p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink)) = softmax_j / (1 + exp(sink - lse)).
    The returned lse excludes the sink."""
    if HAS_SINKS:
        sink2 = tl.load(sink_ptr + heads).to(tl.float32) * _LOG2E
        o = o / (1.0 + tl.exp2(sink2 - lse2))[:, None]
    return o, lse2 * _LN2
