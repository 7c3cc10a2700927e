"""Row-wise kernels (RMS norm, RoPE) and the fused mHC weights: Triton (interpreter on CPU,
compiled on CUDA) against the plain-torch references the CPU engine runs."""

from __future__ import annotations

import pytest
import torch

from bench import naive
from bench.compare import rel_err
from dsaserve import kernels
from dsaserve.kernels import mhc, reference, rowwise
from tests.kernels_cases import gpu_test


def _rope_inputs(n: int, heads: int, dim: int, half: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device).manual_seed(n + heads + dim)
    x = torch.randn(n, heads, dim, generator=g, device=device).to(dtype)
    angle = torch.rand(n, half, generator=g, device=device) * 6.3
    return x, angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("heads,dim,half", [(3, 24, 4), (1, 20, 8)])
def test_rope_matches_reference(heads, dim, half, inverse):
    x, cos, sin = _rope_inputs(5, heads, dim, half, torch.float32, "cpu")
    out = rowwise.apply_rope(x, cos, sin, inverse)
    ref = reference.apply_rope(x, cos, sin, inverse)
    assert torch.equal(
        out[..., : dim - 2 * half], x[..., : dim - 2 * half]
    )  # nope channels untouched
    assert rel_err(out, ref) < 1e-6


def test_rope_then_inverse_is_identity():
    x, cos, sin = _rope_inputs(4, 2, 16, 4, torch.float32, "cpu")
    back = rowwise.apply_rope(rowwise.apply_rope(x, cos, sin), cos, sin, inverse=True)
    assert rel_err(back, x) < 1e-6


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", [(3, 40), (2, 2, 24)])
def test_rms_norm_matches_reference(shape, weighted):
    x = torch.randn(*shape) * 3 + 0.5
    w = torch.randn(shape[-1]) if weighted else None
    assert rel_err(rowwise.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)) < 1e-6


def test_hc_weights_matches_reference():
    mixes, base, scale = torch.randn(45, 24), torch.randn(24), torch.rand(3) + 0.5
    for got, ref in zip(
        mhc.hc_weights(mixes, base, scale, 4, 20, 1e-6),
        reference.hc_weights(mixes, base, scale, 4, 20, 1e-6),
        strict=True,
    ):
        assert rel_err(got, ref) < 1e-5


def test_dispatch_keeps_elementwise_kernels_in_naive_runs():
    x = torch.randn(2, 8)
    with naive.in_engine():  # on CPU: the reference, exactly
        assert torch.equal(kernels.rms_norm(x, None, 1e-6), reference.rms_norm(x, None, 1e-6))


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_kernels_on_gpu(dtype):
    x, cos, sin = _rope_inputs(512, 64, 512, 32, dtype, "cuda")
    for inverse in (False, True):
        assert (
            rel_err(
                rowwise.apply_rope(x, cos, sin, inverse), reference.apply_rope(x, cos, sin, inverse)
            )
            < 1e-2
        )
    w = torch.randn(512, device="cuda")
    for weight in (None, w):
        assert (
            rel_err(rowwise.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)) < 1e-2
        )
    flat = torch.randn(300, 16384, device="cuda")  # mHC input rows: hc_mult * hidden wide
    assert rel_err(rowwise.rms_norm(flat, None, 1e-6), reference.rms_norm(flat, None, 1e-6)) < 1e-5
    mixes, base, scale = (
        torch.randn(300, 24, device="cuda"),
        torch.randn(24, device="cuda"),
        torch.rand(3, device="cuda") + 0.5,
    )
    for got, ref in zip(
        mhc.hc_weights(mixes, base, scale, 4, 20, 1e-6),
        reference.hc_weights(mixes, base, scale, 4, 20, 1e-6),
        strict=True,
    ):
        assert rel_err(got, ref) < 1e-5
