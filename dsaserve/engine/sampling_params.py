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
    # The prefix-cache namespace (vLLM's `cache_salt`): the request resumes only from prefixes
    # computed under the same salt (engine.prefix_cache.cache, "Namespaces"). None: the shared one.
    cache_salt: str | None = None
    # vLLM's sampling extensions (engine.logits_processors says what each does to the logits):
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    presence_penalty: float = 0.0  # [-2, 2], OpenAI's: once per token the output holds
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI's: per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, vLLM's: tokens of the prompt or the output
    min_p: float = 0.0  # [0, 1]: drop tokens under min_p x the likeliest one's probability
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[str] = field(default_factory=list)  # never generated (their last token
    # is banned where the output already ends with the rest of them)
    allowed_token_ids: list[int] | None = None  # only these (None: every token)

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
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0 < self.repetition_penalty < math.inf,
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}",
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                all(math.isfinite(b) for b in self.logit_bias.values()),
                "logit_bias values must be finite",
            ),
            (
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words must be non-empty strings",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids must not be empty (None allows every token)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        # OpenAI's range for a bias; anything further is as good as a ban or a force
        self.logit_bias = {int(t): max(-100.0, min(100.0, b)) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's tokens (they must be known to sample)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def token_ids_in_use(self) -> list[int]:
        """Every token id a parameter names (for the engine's vocabulary check)."""
        return [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or ())]


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
