"""`dsaserve router`: the OpenAI-compatible HTTP router, served by uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import ipaddress
import logging

import uvicorn

from dsaserve.services.router import http_server
from dsaserve.services.router.app import create_app
from dsaserve.services.router.settings import RouterSettings

log = logging.getLogger(__name__)

# Long streams must not hold a stopping router forever; clients see the connection close.
SHUTDOWN_GRACE_S = 30
OTHER_FILES = 256  # what the router opens besides client connections (gRPC, Redis, logs, ...)

Settings = RouterSettings


def run(settings: RouterSettings) -> None:
    warning = exposure_warning(settings)
    if warning is not None:
        log.warning(warning)  # on stderr at startup: the CLI's logging writes there
    if settings.connection_limit:
        http_server.raise_open_file_limit(settings.connection_limit + OTHER_FILES)
    app = create_app(settings, start_grammar_processes=True)
    uvicorn.Server(
        http_server.config(app, settings, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    ).run()


def exposure_warning(settings: RouterSettings) -> str | None:
    """What to shout when the router is reachable from other machines and asks for no key."""
    if settings.api_keys or is_loopback(settings.host):
        return None
    return (
        f"SERVING WITHOUT AUTHENTICATION on {settings.host}:{settings.port}: anyone who can "
        "reach this address can use the model. Give the router --api-key (DSASERVE_API_KEY), "
        "or bind --host 127.0.0.1."
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may well resolve to a public address
        return False
