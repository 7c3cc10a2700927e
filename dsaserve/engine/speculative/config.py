"""`--speculative-config`: vLLM's JSON for speculative decoding, parsed and checked.

Torch-free (EngineConfig validates it, and the CLI describes it without torch). The one method
served is the checkpoint's own multi-token-prediction layer (`"mtp"`; vLLM's older spelling
`"deepseek_mtp"` is accepted), applied `num_speculative_tokens` times per step as vLLM and
SGLang do for DeepSeek's single MTP layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("mtp", "deepseek_mtp")
MAX_SPECULATIVE_TOKENS = 4
# fields vLLM's SpeculativeConfig has whose only value here is what we do anyway
_NO_OPS: dict[str, tuple[Any, ...]] = {"model": (None,), "draft_tensor_parallel_size": (None, 1)}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafts per request per step, at most
    # choose each step's drafts from the measured acceptance and step cost (down to 0);
    # False: always num_speculative_tokens
    adaptive: bool = False

    @staticmethod
    def parse(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A JSON object (the flag's text) or a dict (`LLM(speculative_config=...)`); None: off.
        Raises ValueError naming the field that is wrong."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {"method", "num_speculative_tokens", "adaptive", *_NO_OPS}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; supported: "
                "method, num_speculative_tokens, adaptive"
            )
        for name, allowed in _NO_OPS.items():
            if value.get(name) not in allowed:
                raise ValueError(
                    f"speculative_config.{name}: the draft is the checkpoint's own MTP layer; "
                    f"only {allowed} is accepted, got {value[name]!r}"
                )
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method: {method!r} is not served; supported: "
                f"{', '.join(METHODS)} (the checkpoint's multi-token-prediction layer)"
            )
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        adaptive = value.get("adaptive", False)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        return SpeculativeConfig("mtp", k, adaptive)
