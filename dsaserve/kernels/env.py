"""Where the Triton kernels run: compiled for a CUDA device, or in Triton's interpreter.

On a machine without CUDA the kernels are defined under the interpreter (``TRITON_INTERPRET=1``
is set before any ``@triton.jit`` runs), so tests can launch them on CPU tensors. Triton decides
at decoration time, which is why this module must be imported before the kernel modules.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter runs bf16 tl.dot on raw bit patterns (triton-lang/triton#11584): kernels take
# this as a constexpr and upcast dot operands to fp32 when it is set.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

# The Gluon kernels of kernels.hopper on sm_90 devices (DSASERVE_GLUON=0: their Triton twins,
# e.g. to measure one against the other through the whole engine).
GLUON: bool = os.environ.get("DSASERVE_GLUON", "1") != "0"


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill; a token 4 under the interpreter, which keeps CPU grids tiny."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get an exact fp32 dot (tests); bf16/fp16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
