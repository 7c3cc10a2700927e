"""Request bodies read under `--max-request-bytes`, whatever their Content-Length says.

A body is counted as it arrives (a missing or lying Content-Length, a chunked upload) and the
read stops at the limit; a declared length over it is refused before anything is read. Only then
does FastAPI parse and validate, so a huge body never costs more memory than the limit. After
the 413, uvicorn reads and discards the rest of the upload (keeping the connection open): closing
instead would reset a client still sending, and it would never see the 413.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.metrics import CLIENT_CLOSED


class LimitedRoute(APIRoute):
    """An APIRoute that reads the body within the router's limit before FastAPI sees it.

    FastAPI's documented way to change how a body is read is a custom route class with a
    Request subclass; reading here, outside FastAPI's parsing, keeps the 413 from being turned
    into its generic "error parsing the body" 400.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def read_then_handle(request: Request) -> Response:
            limit = request.app.state.router.settings.max_request_bytes
            return await handler(await _read(request, limit))

        return read_then_handle


class _ReadRequest(Request):
    """A request whose body has been read already."""

    def __init__(self, request: Request, body: bytes) -> None:
        super().__init__(request.scope, request.receive)
        self._body = body  # Starlette's Request.body() returns this cached body


async def _read(request: Request, limit: int) -> Request:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"declares {declared} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, "is longer")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(
            CLIENT_CLOSED,
            "The client closed the connection while sending the request body.",
            cause="client_disconnect",
        ) from None
    return _ReadRequest(request, b"".join(chunks))


def _too_large(limit: int, what: str) -> APIError:
    return APIError(
        413,
        f"The request body {what}, but this router accepts at most {limit} bytes "
        "(--max-request-bytes).",
        code="request_too_large",
    )
