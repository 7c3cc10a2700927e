"""The settings of a prefill and a decode worker: the engine's, plus how the process serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsaserve.engine.config import EngineConfig, setting
from dsaserve.services.connections import GrpcTLS
from dsaserve.services.registry import DEFAULT_TTL_S


@dataclass(frozen=True)
class WorkerSettings:
    """Worker process"""

    engine: EngineConfig = field(default_factory=EngineConfig)
    tls: GrpcTLS = field(default_factory=GrpcTLS)
    model: str | None = setting(None, "model directory (default: the built-in demo model)")
    served_model_name: str | None = setting(
        None, "model id in the registry (default: the model directory's name)"
    )
    host: str = setting("127.0.0.1", "gRPC, probe and NIXL bind address (0.0.0.0: every interface)")
    port: int = setting(50051, "gRPC port")
    advertise_host: str | None = setting(
        None,
        "host other processes reach this worker at (default: --host, or 127.0.0.1 when --host "
        "is 0.0.0.0); NIXL moves KV over the interface that has this address",
    )
    worker_id: str | None = setting(None, "registry id (default: role-hostname-random)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "the worker registry")
    cluster_token: str = setting("", "shared secret every internal call must carry (required)")
    registry_ttl_s: float = setting(
        DEFAULT_TTL_S,
        "seconds the registry keeps this worker without a heartbeat",
        flag="--registry-ttl",
    )
    metrics_port: int = setting(9100, "HTTP port of /metrics, /live and /ready (0 = off)")
    transfer_timeout: float = setting(
        60.0,
        "seconds one KV pull may take (a decode worker's of a prompt; a prefill worker's of a "
        "conversation's state a decode worker lends it)",
    )

    def __post_init__(self) -> None:
        if not self.cluster_token:
            raise ValueError(
                "--cluster-token (or DSASERVE_CLUSTER_TOKEN) is required: workers reject calls "
                "without it"
            )
        if self.registry_ttl_s <= 0:
            raise ValueError(f"--registry-ttl must be positive, got {self.registry_ttl_s}")


@dataclass(frozen=True)
class PrefillSettings(WorkerSettings):
    """Prefill worker"""

    lease_seconds: float = setting(
        30.0,
        "how long a prefilled request's KV waits for a decode worker to read it, at least (100 "
        "of the worker's measured steps when that is longer: a slow or loaded worker)",
    )


@dataclass(frozen=True)
class DecodeSettings(WorkerSettings):
    """Decode worker"""

    port: int = setting(50052, "gRPC port")
    metrics_port: int = setting(9101, "HTTP port of /metrics, /live and /ready (0 = off)")
    stream_interval: int = setting(
        1,
        "new tokens per streamed message (SGLang's and vLLM's --stream-interval): above 1 the "
        "router and gRPC pay their per-message cost once for that many tokens, and clients get "
        "them in bursts",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
