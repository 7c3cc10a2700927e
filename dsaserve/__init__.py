"""dsaserve: prefill/decode-disaggregated serving of DeepSeek's sparse-attention models.

    engine      one GPU group's runtime (no networking): models, KV pools, scheduler, sampler
    kernels     Triton (and Gluon) kernels with plain-torch references
    services    the processes: router, prefill and decode workers, registry, the `dsaserve` CLI

The offline API, as vLLM's: `from dsaserve import LLM, SamplingParams`. Importing this package
loads nothing (the router runs without torch): the two names are read on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsaserve.engine.llm import LLM
    from dsaserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
_OFFLINE_API = {"LLM": "dsaserve.engine.llm", "SamplingParams": "dsaserve.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _OFFLINE_API:
        raise AttributeError(f"module 'dsaserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_OFFLINE_API[name]), name)
