"""dsaserve engine: one GPU group's runtime for DeepSeek-V4 (no networking).

`LLM` and `SamplingParams` are imported lazily so that torch-free users of this package
(the router imports `engine.text.tokenizer`) never pay for, or need, torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
