"""The router's HTTP server: uvicorn on uvloop and httptools, with read deadlines and a cap on
open connections.

uvicorn bounds neither how long a client may take to send a request's head nor how long it may
pause inside a body, so stalled connections (idle, half a header, half a body: slowloris) stay
open for good, and `ulimit -n` of them lock every client out. `BoundedHTTPProtocol` closes a
connection whose request head is not complete within `--header-read-timeout` of its opening (or
of its previous response: bytes trickled in do not extend it), and one that sends nothing for
`--body-read-timeout` inside a body (unless the router itself paused reading). Above
`--max-connections` open connections a new one gets a 503 and is closed before anything is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsaserve.services.router.settings import RouterSettings

log = logging.getLogger(__name__)

# Over the connection cap: the OpenAI error body, sent before the request is read.
_FULL_BODY = json.dumps(
    {
        "error": {
            "message": "The router has too many open connections; retry later.",
            "type": "service_unavailable_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n"
) + _FULL_BODY


class BoundedHTTPProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C: the per-chunk framing cost of a stream is a
    tenth of h11's, `loadtest/README.md` "router_cpu.py") with read deadlines and a connection
    cap (class attributes, set by `protocol_class`).

    What the client owes follows the parser's callbacks: a request head from the connection's
    opening and from each complete response (`_in_message` False), body bytes or the message's
    end from its head on (`_in_message` True), nothing from the message's end to the response's."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 0  # 0: no cap

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._in_message = False
        if self.max_connections and len(self.connections) > self.max_connections:
            transport.write(_FULL)
            transport.close()
            return
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._in_message = True
        self._arm(self.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_message = False
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            # a pipelined request read in part still owes its body; else the next head is owed
            self._arm(self.body_timeout_s if self._in_message else self.header_timeout_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(seconds, self._timed_out, seconds)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _timed_out(self, seconds: float) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the router is not reading: not the client's delay
            self._arm(seconds)
            return
        owed = "body bytes" if self._in_message else "complete request head"
        log.info("closing a connection that sent no %s for %g s", owed, seconds)
        self.transport.close()


def protocol_class(settings: RouterSettings) -> type[BoundedHTTPProtocol]:
    """`BoundedHTTPProtocol` with the settings' deadlines and cap."""
    return type(
        "RouterHTTPProtocol",
        (BoundedHTTPProtocol,),
        {
            "header_timeout_s": settings.header_read_timeout_s,
            "body_timeout_s": settings.body_read_timeout_s,
            "max_connections": settings.connection_limit,
        },
    )


def config(app: Any, settings: RouterSettings, **options: Any) -> uvicorn.Config:
    """The uvicorn config that serves the router app under the settings' limits."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_class(settings),
        loop="uvloop",  # the event loop and socket transports in C (loadtest/README.md)
        **options,
    )


def raise_open_file_limit(wanted: int) -> None:
    """Raise this process's soft open-file limit toward `wanted` (up to the hard limit), so
    the connection cap, not EMFILE, decides who is refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning(
            "the open-file limit (%d) is below --max-connections + headroom (%d): "
            "clients may be refused by the kernel first",
            target,
            wanted,
        )
