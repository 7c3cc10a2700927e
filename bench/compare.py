"""How far an output is from its reference: the error measure the tests and the benches'
correctness checks share (bench/ never imports tests/; tests import this)."""

from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the finite part of ref (0 when ref is all zero); out must be
    inf/nan exactly where ref is."""
    out, ref = out.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)), "inf/nan pattern differs"
    return _masked(out, ref, finite)


def rel_err_or_nan(out: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err, but NaN where either holds a NaN or their infs differ: what a bench records of
    a broken output (the row fails every bound and the run goes on), where a test stops."""
    out, ref = out.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    if ref.isnan().any() or not torch.equal(finite, torch.isfinite(out)):
        return math.nan
    return _masked(out, ref, finite)


def _masked(out: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor) -> float:
    diff = (out - ref)[finite].norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff
