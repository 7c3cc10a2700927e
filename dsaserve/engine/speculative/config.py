"""`--speculative-config`: vLLM's JSON for speculative decoding, parsed and checked.

Torch-free (EngineConfig validates it, and the CLI describes it without torch). Two methods are
served, each the checkpoint's own draft head (engine.speculative.draft_head checks which one a
checkpoint carries):

- `"mtp"` (vLLM's older spelling `"deepseek_mtp"` accepted): the multi-token-prediction layer,
  applied `num_speculative_tokens` times per step as vLLM and SGLang do for DeepSeek's one layer;
- `"dspark"`: the DSpark head, which drafts `num_speculative_tokens` (gamma; the checkpoint's
  `dspark_block_size` when left out) in one pass.

`"adaptive": true` (vLLM's `"enable_adaptive_verification"` for DSpark) lets each step verify
fewer drafts where they do not pay for their rows: MTP from the measured acceptance, DSpark per
request from its confidence head (engine.speculative.adaptive).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MTP, DSPARK = "mtp", "dspark"
METHODS = {"mtp": MTP, "deepseek_mtp": MTP, "dspark": DSPARK}
MAX_SPECULATIVE_TOKENS = {MTP: 4, DSPARK: 16}
# fields vLLM's SpeculativeConfig has whose only value here is what we do anyway
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "draft_tensor_parallel_size": (None, 1),
    "draft_sample_method": (None, "greedy"),  # drafts are the draft head's argmax
    "rejection_sample_method": (None, "standard"),  # per-token min(1, p / q), then a residual
}
_FIELDS = ("method", "num_speculative_tokens", "adaptive", "enable_adaptive_verification",
           "model", *_NO_OPS)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # MTP or DSPARK
    # drafts per request per step, at most; 0 (DSpark only): the checkpoint's block size
    num_speculative_tokens: int
    # verify fewer drafts where they do not pay (MTP: a K per step; DSpark: per request, by
    # confidence), down to 0; False: always num_speculative_tokens
    adaptive: bool = False
    # vLLM's standalone drafter: only the checkpoint's own head is served (draft_head refuses
    # anything else at start, naming what it found there)
    model: str | None = None

    def with_drafts(self, k: int) -> SpeculativeConfig:
        """This config with num_speculative_tokens resolved to k."""
        return SpeculativeConfig(self.method, k, self.adaptive, self.model)

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
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; supported: {', '.join(_FIELDS)}"
            )
        for name, allowed in _NO_OPS.items():
            if value.get(name) not in allowed:
                raise ValueError(
                    f"speculative_config.{name}: only {allowed} is served, got {value[name]!r}"
                )
        method = METHODS.get(value.get("method"))  # type: ignore[arg-type]
        if method is None:
            raise ValueError(
                f"speculative_config.method: {value.get('method')!r} is not served; supported: "
                f"{', '.join(METHODS)} (the checkpoint's MTP layer or DSpark head)"
            )
        most = MAX_SPECULATIVE_TOKENS[method]
        k = value.get("num_speculative_tokens", 0 if method == DSPARK else None)
        least = 0 if method == DSPARK and "num_speculative_tokens" not in value else 1
        if not isinstance(k, int) or isinstance(k, bool) or not least <= k <= most:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, {most}] "
                f"for method {method!r}, got {k!r}"
            )
        adaptive = value.get("adaptive", value.get("enable_adaptive_verification", False))
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        model = value.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model must be a path, got {model!r}")
        return SpeculativeConfig(method, k, adaptive, model)
