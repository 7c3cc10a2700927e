"""OpenAI-style errors: one exception type, its JSON body, and the mappings into it.

Every failure a client sees has the body `{"error": {"message", "type", "param", "code"}}`,
whether it comes from validation, FastAPI itself (unknown route, malformed JSON), or a worker's
gRPC status. `cause` is not sent to clients: it labels the failure metric.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_CAUSES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "invalid_request"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.cause = cause or _CAUSES.get(status, "internal")

    def body(self) -> dict[str, Any]:
        error_type = _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# gRPC status from a worker -> (HTTP status, metric cause). Anything else is a 500.
_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "worker_invalid_argument"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "worker_busy"),
    grpc.StatusCode.UNAVAILABLE: (503, "worker_unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (500, "worker_failed_precondition"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNAUTHENTICATED: (500, "cluster_token"),
}


def from_grpc(error: grpc.aio.AioRpcError, role: str, address: str) -> APIError:
    status, cause = _GRPC_STATUS.get(error.code(), (500, "worker_error"))
    where = f"{role} worker {address}"
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = (
            f"The request timed out on the {where}; raise --request-timeout or shorten max_tokens."
        )
    elif error.code() == grpc.StatusCode.UNAUTHENTICATED:
        message = (
            f"The {where} rejected the cluster token; "
            "give the router and workers the same --cluster-token."
        )
    elif error.code() == grpc.StatusCode.UNAVAILABLE:
        message = f"The {where} is unavailable ({error.details()}); retry the request."
    else:
        message = f"{where}: {error.details()}"
    return APIError(status, message, cause=cause)


def timeout_error(seconds: float, where: str) -> APIError:
    return APIError(
        504,
        f"The request timed out after {seconds:g} s {where}; "
        "raise --request-timeout or retry later.",
        cause="timeout",
    )


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The first pydantic error as (message, param), phrased for someone fixing their request."""
    first = errors[0]
    # Drop "body" and pydantic's union-member tags ("str", "list[int]", "function-after[...]").
    loc = [p for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    if not loc:
        if first.get("type") == "missing":
            return "The request body is empty; send a JSON object.", None
        return f"The request body must be a JSON object: {first.get('msg')}", None
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"Invalid value for '{param}': {msg}", param


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part
    )


def install_handlers(app: FastAPI) -> None:
    """Route every error FastAPI can raise through the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.failure = exc
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return await _api_error(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (
                f"Unknown route {request.method} {request.url.path}; "
                "see GET /v1/models and POST /v1/chat/completions."
            )
        else:
            message = str(exc.detail)
        return await _api_error(request, APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await _api_error(
            request, APIError(500, f"Internal router error: {type(exc).__name__}: {exc}")
        )
