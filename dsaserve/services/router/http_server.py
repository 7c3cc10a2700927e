"""The router's HTTP server: uvicorn on uvloop and httptools, with read deadlines and a cap on
open connections.

uvicorn bounds neither how long a client may take to send a request's head nor how long it may
pause inside a body, so stalled connections (idle, half a header, half a body: slowloris) stay
open for good, and `ulimit -n` of them lock every client out. `BoundedHTTPProtocol` closes a
connection whose request head is not complete within `--header-read-timeout` of its opening (or
of its previous response: bytes trickled in do not extend it), and one that sends nothing for
`--body-read-timeout` inside a body (unless the router itself paused reading). Above
`--max-connections` open connections a new one gets a 503 and is closed before anything is read.

Nor does llhttp bound a request head: a client could stream megabytes of one header, which the
parser keeps until the head ends. A head that has more than `--h11-max-incomplete-event-size`
bytes (counted as they arrive, so at most one read past the bound is ever held) or more than
`--h11-max-header-count` header fields gets a 431 and its connection is closed (vLLM's flag
names; their defaults here are nginx's order of magnitude, not vLLM's 4 MiB).
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


def _refusal(status: bytes, message: str, kind: str, code: str, extra: bytes = b"") -> bytes:
    """A whole response with the OpenAI error body, written before the app sees the request,
    after which the connection is closed."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra
        + b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
        + body
    )  # fmt: skip


LINGER_S = 2.0  # how long a refused connection's input is still read (and dropped)

# Over the connection cap: sent before the request is read.
_FULL = _refusal(
    b"503 Service Unavailable",
    "The router has too many open connections; retry later.",
    "service_unavailable_error",
    "too_many_connections",
    b"retry-after: 1\r\n",
)


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
    max_head_bytes = 32 << 10
    max_headers = 100

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._in_message = False
        self._head_bytes = 0  # bytes received since the head being read began
        self._header_count = 0  # its header fields so far
        self._refused = False  # a 431 went out: nothing more is read or answered
        if self.max_connections and len(self.connections) > self.max_connections:
            transport.write(_FULL)
            transport.close()
            return
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_message:
            self._head_bytes += len(data)
        super().data_received(data)
        # (after parsing: a read that also carries the body's start completes the head)
        if not self._in_message and self._head_bytes > self.max_head_bytes:
            self._refuse(f"more than {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._refuse(f"more than {self.max_headers} header fields")
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._head_bytes = 0
        super().on_headers_complete()
        self._in_message = True
        self._arm(self.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        super().on_body(body)
        self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._in_message = False
        self._disarm()

    def _refuse(self, what: str) -> None:
        """431 for a request head over a bound; the app never sees the request."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        log.info("refusing a request head with %s", what)
        message = (
            f"The request head has {what}; the router accepts at most {self.max_head_bytes} "
            f"bytes and {self.max_headers} header fields (--h11-max-incomplete-event-size, "
            "--h11-max-header-count)."
        )
        self.transport.write(
            _refusal(
                b"431 Request Header Fields Too Large",
                message,
                "invalid_request_error",
                "request_header_fields_too_large",
            )
        )
        # A lingering close: closing with the rest of the head unread would send a reset,
        # which can destroy the 431 before the client reads it. So the answer ends with a FIN,
        # what still arrives is dropped unread, and the connection closes a little later.
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

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
    """`BoundedHTTPProtocol` with the settings' deadlines and bounds."""
    return type(
        "RouterHTTPProtocol",
        (BoundedHTTPProtocol,),
        {
            "header_timeout_s": settings.header_read_timeout_s,
            "body_timeout_s": settings.body_read_timeout_s,
            "max_connections": settings.connection_limit,
            "max_head_bytes": settings.h11_max_incomplete_event_size,
            "max_headers": settings.h11_max_header_count,
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
