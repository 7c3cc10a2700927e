"""Hopper-only kernels written in Gluon (``triton.experimental.gluon``): TMA loads completing on
mbarriers, ``warpgroup_mma``, explicit register layouts.

Each kernel here has a Triton twin elsewhere in ``kernels/`` that stays the fallback (other GPUs,
shapes the Gluon version does not take) and the CPU-tested path: Gluon has no interpreter, so
these run only on an sm_90 device. ``kernels.hopper.available(device)`` says whether they can.
Import the modules of this package only after that check: they import Gluon at load time.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _gluon_importable() -> bool:
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on `device`: a CUDA device of compute capability 9.x
    and a Triton with Gluon's Hopper module."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and _gluon_importable()
