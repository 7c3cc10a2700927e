"""The router's settings, one frozen dataclass built from flags (or by tests directly)."""

from __future__ import annotations

from dataclasses import dataclass

from services.registry import DEFAULT_TTL_S


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str
    redis_url: str
    served_model_name: str | None = None  # default: the model dir's basename
    api_keys: tuple[str, ...] = ()  # empty = no authentication
    policy: str = "least_load"
    max_inflight: int = 256
    max_queue: int = 1024
    cluster_token: str = ""
    registry_ttl_s: float = DEFAULT_TTL_S
    request_timeout_s: float = 600.0
    host: str = "0.0.0.0"
    port: int = 8000

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
