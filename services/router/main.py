"""`dsaserve router`: the OpenAI-compatible HTTP router, served by uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import uvicorn

from .app import create_app
from .settings import RouterSettings

# Long streams must not hold a stopping router forever; clients see the connection close.
SHUTDOWN_GRACE_S = 30

Settings = RouterSettings


def run(settings: RouterSettings) -> None:
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
