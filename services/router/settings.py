"""The router's settings: one frozen dataclass, the source of its flags and DSASERVE_* variables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.config import setting
from services.connections import GrpcTLS
from services.registry import DEFAULT_TTL_S

from .policy import DEFAULT_BALANCE_BOUND, POLICIES


@dataclass(frozen=True)
class RouterSettings:
    """Router"""

    model_dir: str = setting(
        dataclasses.MISSING,
        "model directory (HF layout: config.json + tokenizer files)",
        flag="--model",
    )
    redis_url: str = setting("redis://127.0.0.1:6379/0", "the worker registry")
    served_model_name: str | None = setting(
        None, "model id clients send (default: the model directory's name)"
    )
    api_keys: tuple[str, ...] = setting(
        (), "accepted Bearer key (repeatable; none = no authentication)", flag="--api-key"
    )
    policy: str = setting(
        "cache_aware",
        "worker balancing policy: cache_aware sends a prompt to the prefill worker whose prefix "
        "cache holds the longest start of it (what each worker holds: a Redis stream of its "
        "cache's changes), within --balance-abs-threshold of the least load; the others balance "
        "load only",
        choices=sorted(POLICIES),
    )
    balance_abs_threshold: int = setting(
        DEFAULT_BALANCE_BOUND,
        "cache_aware: the most a worker's load (running + waiting + this router's calls) may "
        "exceed the least loaded worker's for a prefix it holds to still go there",
    )
    max_inflight: int = setting(256, "requests running at once")
    max_queue: int = setting(1024, "requests waiting for a slot before 429s")
    max_inflight_per_key: int = setting(
        0, "requests one API key may have running or queued at once; 429 above (0 = no limit)"
    )
    max_request_bytes: int = setting(8 << 20, "largest request body accepted; 413 above")
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's max_position_embeddings)"
    )
    cluster_token: str = setting("", "shared secret sent to workers on every call")
    registry_ttl_s: float = setting(
        DEFAULT_TTL_S, "seconds a worker record lives without a heartbeat", flag="--registry-ttl"
    )
    request_timeout_s: float = setting(
        600.0, "seconds from a request's arrival to its last token", flag="--request-timeout"
    )
    host: str = setting(
        "127.0.0.1", "HTTP bind address (0.0.0.0: every interface; give an --api-key then)"
    )
    port: int = setting(8000, "HTTP port")
    stall_timeout_s: float = setting(
        30.0,
        "seconds a decode stream may send nothing before it is abandoned and its worker skipped",
        flag="--stall-timeout",
    )
    default_thinking: bool = setting(
        False,
        "render chats in thinking mode unless a request says (chat_template_kwargs.thinking, "
        "reasoning_effort); replies then carry reasoning_content",
    )
    response_ttl_s: float = setting(
        3600.0,
        "seconds a Responses API response (store: true) stays in Redis for previous_response_id",
        flag="--response-ttl",
    )
    tls: GrpcTLS = field(default_factory=GrpcTLS)  # of the gRPC calls to workers

    def __post_init__(self) -> None:
        checks = [
            (self.max_inflight >= 1, f"max_inflight must be >= 1, got {self.max_inflight}"),
            (self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}"),
            (
                self.balance_abs_threshold >= 0,
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}",
            ),
            (
                self.max_inflight_per_key >= 0,
                f"max_inflight_per_key must be >= 0, got {self.max_inflight_per_key}",
            ),
            (
                self.max_inflight_per_key == 0 or bool(self.api_keys),
                "max_inflight_per_key limits each --api-key; give the router API keys",
            ),
            (
                self.max_request_bytes >= 1,
                f"max_request_bytes must be >= 1, got {self.max_request_bytes}",
            ),
            (
                self.stall_timeout_s > 0,
                f"stall_timeout must be positive, got {self.stall_timeout_s}",
            ),
            (self.response_ttl_s > 0, f"response_ttl must be positive, got {self.response_ttl_s}"),
            (
                self.request_timeout_s > 0,
                f"request_timeout must be positive, got {self.request_timeout_s}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 2,
                f"max_model_len must be >= 2, got {self.max_model_len}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
