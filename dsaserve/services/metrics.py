"""Prometheus pieces every dsaserve process shares: latency buckets and the exposition response.

Each process (and each app built in a test) owns a private `CollectorRegistry`, so two apps in
one interpreter never fight over metric names in the global default registry.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# Seconds. TTFT spans a cached short prompt to a long prefill behind a queue; ITL is per token.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The body and content type of a `GET /metrics` answer for one registry."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
