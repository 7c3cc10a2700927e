"""A worker's HTTP side: /live (the process answers), /ready (registered, engine alive) and
/metrics (Prometheus), served by uvicorn on a thread of its own so that a busy event loop or
engine never makes a probe time out."""

from __future__ import annotations

import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry

from dsaserve.services.metrics import exposition


def probe_app(ready: Callable[[], bool], registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title="dsaserve worker probes", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/live", response_class=PlainTextResponse)
    def live() -> str:
        return "ok\n"

    @app.get("/ready", response_class=PlainTextResponse)
    def is_ready() -> Response:
        ok = ready()
        return PlainTextResponse("ready\n" if ok else "not ready\n", status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = exposition(registry)
        return Response(body, media_type=content_type)

    return app


class ProbeServer:
    """uvicorn on a daemon thread (off the main thread, it installs no signal handlers)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="probes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
