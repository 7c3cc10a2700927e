"""Per-request sampling parameters (the offline API's and the services' common currency)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's top_logprobs cap)
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by them
# overflows fp32 and the argmax of infinities is the first one, not the likeliest token.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None  # same seed -> same tokens, wherever the request runs
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: each sampled token's logprob and the k likeliest alternatives
    # (vLLM's convention), from the model's raw distribution (engine.logprobs).
    logprobs: int | None = None
    # Structured output: an llguidance grammar (Lark-like text) the whole output must follow;
    # EOS only once it is complete (engine.structured, engine.text.chat.constraint).
    grammar: str | None = None
    # None: none; k >= 0: each prompt token's logprob (after the first, which nothing predicts)
    # and the k likeliest alternatives at its place (vLLM's `prompt_logprobs`). The prompt is
    # then computed whole, never resumed from the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop or []), list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (
                0 <= self.temperature < math.inf,
                f"temperature must be finite and >= 0, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k}"),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop strings must be non-empty strings",
            ),
            (
                self.seed is None or 0 <= self.seed < 2**63,
                f"seed must be in [0, 2**63), got {self.seed}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class ContextLengthError(ValueError):
    """Prompt plus output would not fit the context; `param` names what to shorten."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param  # "prompt" | "max_tokens"


def resolve_max_tokens(prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """The output budget of a request: what was asked for, or by default the rest of the context.

    The one place that holds a request to the context length (the router before any GPU work,
    the engine for offline and gRPC callers).
    """
    if prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for output; shorten it to at most "
            f"{max_model_len - 1} tokens.",
            "prompt",
        )
    room = max_model_len - prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"{prompt_tokens + requested} tokens were requested ({prompt_tokens} in the prompt, "
            f"{requested} for the output). Shorten the prompt or lower max_tokens (at most "
            f"{room} here).",
            "max_tokens",
        )
    return requested
