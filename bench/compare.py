"""How far an output is from its reference: the error measure the tests and the benches'
correctness checks share (bench/ never imports tests/; tests import this)."""

from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the finite part of ref (0 when ref is all zero); out must be
    inf/nan exactly where ref is."""
    err = rel_err_or_nan(out, ref)
    assert not math.isnan(err), "inf/nan pattern differs"
    return err


def rel_err_or_nan(out: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err, but NaN where out's inf/nan pattern differs from ref's: what a bench records of
    a broken output (the row fails its check and the run goes on), where a test stops."""
    out, ref = out.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)):
        return math.nan
    diff = (out - ref)[finite].norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff
