"""How far an output is from its reference: the error measure the kernel tests and the benches'
correctness checks share."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the finite part of ref (0 when ref is all zero)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)), "inf/nan pattern differs"
    diff = (out - ref)[finite].norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff
