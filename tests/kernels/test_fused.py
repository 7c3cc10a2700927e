"""Fused decode glue (kernels.fused_*): the Triton kernels (interpreter on CPU, compiled on CUDA)
match their torch references (kernels.fused_reference, which the engine runs on CPU and which
the model-parity tests hold to HF transformers).

Every op runs on a real KVPool/StepState (bench.fused_cases): the tiny model's widths on CPU,
V4-Flash's on a GPU. Decode rows sit at positions chosen for the edges: position 0, the first
CSA window (no previous window to overlap), windows that close for CSA only and for both CSA
and HCA, rows whose windows stay open; a mixed step adds a prefill chunk behind them.
"""

from __future__ import annotations

import pytest
import torch

from bench.fused_cases import GlueStep, Op, as_tuple, compare, model_config, written
from dsaserve import kernels
from tests.kernels_cases import gpu_test

POSITIONS = [0, 3, 7, 15, 18, 47, 63, 100]  # tiny model: CSA rate 4, HCA rate 16, window 16
PREFILL = ((20, 6),)  # a chunk of 6 rows of a request that has 20 tokens
OPS = [
    "compress_csa",
    "compress_index",
    "compress_hca",
    "indexer_query",
    "sparse_indices_swa",
    "sparse_indices_csa",
    "sparse_indices_hca",
    "hc_pre",
    "hc_pre_merge",
    "hc_merge",
    "attention_pre",
    "attention_post",
]
# compressors handle decode rows only; attention_pre writes the ring of decode rows only, the
# engine also persists prefill rows (after attention), so a mixed step differs there by design
DECODE_ONLY = {"compress_csa", "compress_index", "compress_hca", "attention_pre"}


def _op(step: GlueStep, name: str) -> Op:
    ops = {op.name: op for op in step.ops()}
    assert set(ops) == set(OPS)
    return ops[name]


@pytest.fixture(scope="module")
def tiny_widths():
    """The tiny model's widths (a model config; no checkpoint)."""
    return model_config("tiny")


@pytest.mark.parametrize(
    "dtype,mixed,tol",
    [(torch.float32, False, 1e-5), (torch.float32, True, 1e-5), (torch.bfloat16, False, 3e-2)],
)
@pytest.mark.parametrize("name", OPS)
def test_triton_matches_reference(tiny_widths, name, dtype, mixed, tol):
    """fp32: rounding-level agreement. bf16: the interpreter truncates fp32 -> bf16 casts
    (torch rounds to nearest), which leaves up to about 1% in the merged streams."""
    if mixed and name in DECODE_ONLY:
        pytest.skip("decode rows only")
    step = GlueStep(tiny_widths, POSITIONS, device="cpu", dtype=dtype, prefill=PREFILL * mixed)
    op = _op(step, name)
    assert compare(op, op.run(op.fused, "triton"), op.run(op.reference)) < tol


@pytest.mark.parametrize("kind", ["csa", "index", "hca"])
def test_compress_decode_writes_only_closed_windows(tiny_widths, kind):
    """The kernel writes one pool row per closing window (none to the trash slot), and a
    window's entry depends only on its own tokens: rewriting the ring rows of other positions
    (the stale ones before window 0 included) changes nothing."""
    step = GlueStep(tiny_widths, POSITIONS, device="cpu", dtype=torch.float32)
    op = step.compress(kind)
    (_, written) = op.run(op.fused, "triton")
    inputs, target, trash = op.args
    changed = (written[2] != target).any(dim=1)
    assert int(changed.sum()) == op.info["closing_rows"] > 0
    assert not changed[trash]  # the trash slot
    rate = inputs.ape.shape[0]
    overlap = inputs.kv.shape[1] == 2 * inputs.norm_weight.shape[0]
    ring_kv, ring_gate = inputs.ring_kv, inputs.ring_gate
    rows = ring_kv.shape[1]
    for b, pos in enumerate(POSITIONS):  # scramble what no closing window of row b may read
        w = pos // rate
        if (pos + 1) % rate:
            continue
        first = max(w - 1, 0) * rate if overlap else w * rate
        used = {p % rows for p in range(first, pos + 1)}
        other = torch.tensor([r for r in range(rows) if r not in used], dtype=torch.long)
        slab = int(inputs.slab[b])
        ring_kv[slab, other] = torch.randn(len(other), ring_kv.shape[-1]) * 100
        ring_gate[slab, other] = torch.randn(len(other), ring_gate.shape[-1]) * 100
    (_, again) = op.run(op.fused, "triton")
    assert torch.equal(again[2], written[2])


def test_rope_ops_touch_only_rope_channels(tiny_widths):
    """indexer_query and attention_post rotate the trailing rope_dim channels, nothing else;
    attention_post undoes attention_pre's rotation of the same row's query."""
    step = GlueStep(tiny_widths, POSITIONS, device="cpu", dtype=torch.float32)
    rope = tiny_widths.rope_dim
    for op in (step.indexer_query(), step.attention_post()):
        q = op.args[0]
        out, _ = op.run(op.fused, "triton")
        rotated = as_tuple(out)[0]
        assert torch.equal(rotated[..., :-rope], q[..., :-rope])
        assert not torch.equal(rotated[..., -rope:], q[..., -rope:])
    pre = step.attention_pre()
    with kernels.use_backend("triton"):
        (q, _), _ = pre.run(pre.fused, "triton")
        back = kernels.attention_post(q.clone(), *pre.args[4:6])
    normed = kernels.reference.rms_norm(pre.args[0], None, tiny_widths.rms_norm_eps)
    torch.testing.assert_close(back, normed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge", [False, True])
def test_hc_pre_splits_long_rows(tiny_widths, merge):
    """With many rows each mix program walks several channel blocks (fewer, longer splits);
    the partial sums still add up to the reference."""
    step = GlueStep(tiny_widths, list(range(130)), device="cpu", dtype=torch.float32)
    op = step.hc_pre(merge)
    assert compare(op, op.run(op.fused, "triton"), op.run(op.reference)) < 1e-5


def test_hc_pre_weights_are_mhc_weights(tiny_widths):
    """comb comes out doubly stochastic (columns exactly, rows nearly) and post in (0, 2)."""
    step = GlueStep(tiny_widths, POSITIONS, device="cpu", dtype=torch.float32)
    op = step.hc_pre(merge=True)
    (_, post, comb, _), _ = op.run(op.fused, "triton")
    n = tiny_widths.hc_mult
    assert torch.allclose(comb.sum(-2), torch.ones(len(POSITIONS), n), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(len(POSITIONS), n), atol=2e-2)
    assert ((post > 0) & (post < 2)).all()


# ---------------------------------------------------------------- GPU, V4-Flash widths


def _v4_step(mixed: bool = False) -> GlueStep:
    """64 decode rows around 32K tokens (about a quarter close a CSA window) plus rows that close
    an HCA window, and with `mixed` a 300-row prefill chunk, on a page size of 64."""
    gen = torch.Generator().manual_seed(7)
    positions = (32768 + torch.randint(0, 4096, (60,), generator=gen)).tolist()
    positions += [127, 255, 32767, 128 * 300 - 1]
    return GlueStep(
        model_config("v4-flash"),
        positions,
        device="cuda",
        dtype=torch.bfloat16,
        prefill=((4000, 300),) if mixed else (),
        kv_bytes=1 << 30,
        page_size=64,
    )


@gpu_test
@pytest.mark.parametrize("mixed", [False, True])
def test_fused_glue_on_gpu(mixed):
    """V4-Flash widths, bf16: Triton within bf16 rounding of the references (index lists
    exactly)."""
    step = _v4_step(mixed)
    for op in step.ops():
        if mixed and op.name in DECODE_ONLY:
            continue
        ref = op.run(op.reference)
        err = compare(op, op.run(op.fused, "triton"), ref)
        assert err < 1e-2, (op.name, err)


@gpu_test
def test_fused_glue_replays_in_cuda_graphs():
    """Each Triton op captures in a CUDA graph (a host sync or an allocation sized by data would
    fail the capture) and its replay equals an eager call on the same inputs, bit for bit."""
    step = _v4_step()
    for op in step.ops():
        captured_args, eager_args = op.fresh_args(), op.fresh_args()
        with kernels.use_backend("triton"):
            op.fused(*op.fresh_args(), **op.kwargs)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = op.fused(*captured_args, **op.kwargs)
            graph.replay()
            eager = op.fused(*eager_args, **op.kwargs)
        torch.cuda.synchronize()
        for a, b in zip(as_tuple(captured), as_tuple(eager), strict=True):
            assert (a is None and b is None) or torch.equal(a, b), op.name
        for w in op.writes:
            assert torch.equal(written(captured_args, w), written(eager_args, w)), op.name


# ---------------------------------------------------------------- FP8 pools (--kv-cache-dtype fp8)


@pytest.fixture(scope="module")
def demo():
    """The built-in demo model's widths: 512-wide KV rows with 64 RoPE dims, the FP8 format's."""
    from dsaserve.engine.demo_model import DEMO_MODEL_DIR
    from dsaserve.engine.models.deepseek_v4.config import ModelConfig

    return ModelConfig.from_dir(DEMO_MODEL_DIR)


FP8_POSITIONS = [3, 7, 15, 18]  # windows that close for CSA, for both kinds, and stay open


def _quantized(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, page: int):
    """What an FP8 pool holds after rows went to slots: the reference quantize-on-write."""
    want = pool.clone()
    with kernels.use_backend("reference"):
        kernels.store_rows(want, slots, rows, page)
    return want


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_attention_pre_quantizes_its_rows_into_an_fp8_pool(demo, backend):
    """With an FP8 pool the kv rows attention_pre returns land, quantized, in the scratch and
    ring slots, and nowhere else; q and kv are those of a plain pool."""
    fp8 = GlueStep(demo, FP8_POSITIONS, device="cpu", dtype=torch.float32, kv_cache_dtype="fp8")
    op = fp8.attention_pre()
    cache, scratch, ring = op.args[6], op.args[7], op.args[8]
    assert cache.dtype == torch.uint8
    (q, kv), (written,) = op.run(op.fused, backend)
    plain = torch.zeros(cache.shape[0] * fp8.pool.page_size, demo.head_dim)
    args = (*op.args[:6], plain, scratch, ring)
    with kernels.use_backend(backend):
        q_plain, kv_plain = kernels.attention_pre(*args)
    assert torch.equal(q, q_plain) and torch.equal(kv, kv_plain)
    slots = torch.cat((scratch, ring))
    rows = torch.cat((kv, kv[: ring.shape[0]]))
    assert torch.equal(written, _quantized(cache, slots, rows, fp8.pool.page_size))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["csa", "index"])
def test_compress_decode_quantizes_closed_windows_into_an_fp8_pool(demo, kind, backend):
    """An FP8 target gets exactly the quantized entries a plain target gets, at the same slots
    (closing windows only, no trash row), and the ring the same update."""
    fp8 = GlueStep(demo, FP8_POSITIONS, device="cpu", dtype=torch.float32, kv_cache_dtype="fp8")
    op = fp8.compress(kind)
    target, page = op.args[1], fp8.pool.page_size
    assert target.dtype == torch.uint8
    _, (ring_kv, ring_gate, written) = op.run(op.fused, backend)
    head_dim = op.args[0].norm_weight.shape[0]
    plain = torch.zeros(target.shape[0] * page, head_dim)
    trash = plain.shape[0] - 1  # (the torch path writes open windows there)
    args = (op.fresh_args()[0], plain, trash)
    with kernels.use_backend(backend):
        kernels.compress_decode(*args)
    assert torch.equal(ring_kv, args[0].ring_kv) and torch.equal(ring_gate, args[0].ring_gate)
    slots = (plain != 0).any(dim=1).nonzero()[:, 0]
    slots = slots[slots != trash]
    assert slots.numel() == op.info["closing_rows"] > 0
    assert torch.equal(written, _quantized(target, slots, plain[slots], page))
