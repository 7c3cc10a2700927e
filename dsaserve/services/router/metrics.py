"""The router's Prometheus metrics, and the middleware that counts every request by status."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsaserve.services.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from dsaserve.services.registry import ROLES, Role

# Status reported when the client went away before the answer was complete (nginx's convention).
CLIENT_CLOSED = 499


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "dsaserve_router_"
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Gap between streamed chunks.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.completion_tokens = Counter(
            p + "completion_tokens", "Completion tokens of finished requests.", registry=registry
        )
        self.requests = Counter(
            p + "requests",
            "Requests by endpoint and final status.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.failures = Counter(
            p + "failures", "Failed requests by cause.", ["cause"], registry=registry
        )
        self.queue_depth = Gauge(
            p + "queue_depth", "Requests waiting for admission.", registry=registry
        )
        self.inflight = Gauge(
            p + "inflight_requests", "Admitted requests not yet finished.", registry=registry
        )
        self.live_workers = Gauge(
            p + "live_workers", "Workers in the registry snapshot.", ["role"], registry=registry
        )
        self.unhealthy_workers = Gauge(
            p + "unhealthy_workers",
            "Live workers benched for a cool-down after failing (picked only if no other is).",
            ["role"],
            registry=registry,
        )
        self.marked_unhealthy = Counter(
            p + "workers_marked_unhealthy",
            "Times a worker was benched, by role and reason.",
            ["role", "reason"],
            registry=registry,
        )
        self.registry_up = Gauge(
            p + "registry_up",
            "1 if the last registry refresh reached Redis; at 0 the router routes to the "
            "workers it last saw.",
            registry=registry,
        )
        self.registry_age = Gauge(
            p + "registry_last_refresh_age_seconds",
            "Seconds since the worker snapshot was last read from Redis.",
            registry=registry,
        )

    def track_admission(self, waiting: Callable[[], int], inflight: Callable[[], int]) -> None:
        """Read the admission counters at scrape time instead of mirroring every change."""
        self.queue_depth.set_function(waiting)
        self.inflight.set_function(inflight)

    def track_registry(self, up: Callable[[], bool], age_s: Callable[[], float]) -> None:
        self.registry_up.set_function(lambda: float(up()))
        self.registry_age.set_function(age_s)

    def set_workers(self, live: Callable[[Role], int], unhealthy: Callable[[Role], int]) -> None:
        for role in ROLES:
            self.live_workers.labels(role).set(live(role))
            self.unhealthy_workers.labels(role).set(unhealthy(role))


class RequestCounter:
    """ASGI middleware: count each request under its route and final status, and failures by cause.

    A handler (or a stream that fails after its 200 went out) leaves its `APIError` in
    `request.state.failure`; that status and cause win over the HTTP status actually sent.
    """

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent_status = 500

        async def capture(message: Message) -> None:
            nonlocal sent_status
            if message["type"] == "http.response.start":
                sent_status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        except Exception:  # Starlette's outermost error middleware answers it with a 500
            self._count(scope, 500, "internal")
            raise
        failure = scope.get("state", {}).get("failure")
        self._count(scope, getattr(failure, "status", sent_status), getattr(failure, "cause", None))

    def _count(self, scope: Scope, status: int, cause: str | None) -> None:
        endpoint = getattr(scope.get("route"), "path", "unmatched")
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if cause is not None:
            self.metrics.failures.labels(cause).inc()


class RequestTimer:
    """TTFT, ITL and E2E for one generation, from its arrival time (monotonic seconds)."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now

    def finish(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._metrics.e2e.observe(time.monotonic() - self._arrival)
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.completion_tokens.inc(completion_tokens)
