"""`dsaserve router`: flags (each also a DSASERVE_* variable) and the blocking uvicorn run."""

from __future__ import annotations

import argparse

import uvicorn

from services import flags
from services.registry import DEFAULT_TTL_S

from .app import create_app
from .config import RouterConfig
from .policy import POLICIES

# Long streams must not hold a stopping router forever; clients see the connection close.
SHUTDOWN_GRACE_S = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--model", required=True, help="model directory (HF layout: config.json + tokenizer files)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the model dir's name)",
    )
    parser.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="the worker registry"
    )
    parser.add_argument(
        "--api-key",
        action=flags.Repeatable,
        default=[],
        help="accepted Bearer key (repeatable; none = no auth)",
    )
    parser.add_argument(
        "--policy", choices=sorted(POLICIES), default="least_load", help="worker balancing policy"
    )
    parser.add_argument("--max-inflight", type=int, default=256, help="requests running at once")
    parser.add_argument(
        "--max-queue", type=int, default=1024, help="requests waiting for a slot before 429s"
    )
    parser.add_argument(
        "--cluster-token", default="", help="shared secret sent to workers on every call"
    )
    parser.add_argument(
        "--registry-ttl", type=float, default=DEFAULT_TTL_S, help="worker record TTL in seconds"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds from arrival to last token"
    )
    flags.env_defaults(parser)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model_dir=args.model,
        redis_url=args.redis_url,
        served_model_name=args.served_model_name,
        api_keys=tuple(args.api_key),
        policy=args.policy,
        max_inflight=args.max_inflight,
        max_queue=args.max_queue,
        cluster_token=args.cluster_token,
        registry_ttl_s=args.registry_ttl,
        request_timeout_s=args.request_timeout,
        host=args.host,
        port=args.port,
    )


def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM."""
    config = config_from_args(args)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dsaserve router", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())
