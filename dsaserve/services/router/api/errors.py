"""OpenAI-style errors: one exception type, its JSON body, and the mappings into it.

Every failure a client sees has the body `{"error": {"message", "type", "param", "code"}}`,
whether it comes from validation, FastAPI itself (unknown route, malformed JSON), or a worker's
gRPC status. `cause` is not sent to clients: it labels the failure metric. Nor are the
cluster's insides (worker addresses and ids, what a worker said about its peers): those go to the
router's log, next to the request id.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsaserve.services.router.api.fields import unsupported_message

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

_CAUSES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "invalid_request",
    413: "request_too_large",
}
# Seconds a client should wait before retrying a 429 or 503 (`Retry-After`), unless the error
# knows better: capacity frees up as requests finish, which takes about this long.
DEFAULT_RETRY_AFTER_S = 1


@contextlib.contextmanager
def renamed_params(names: Mapping[str, str]) -> Iterator[None]:
    """An APIError raised inside names the request's field as `names` renames it (its longest
    renamed prefix): a route that runs its request as another API's answers in its own names."""
    try:
        yield
    except APIError as e:
        for old in sorted(names, key=len, reverse=True):
            if e.param is not None and (e.param == old or e.param.startswith(old + ".")):
                e.param = names[old] + e.param[len(old) :]
                break
        raise


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        cause: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Messages may quote client input; a lone surrogate in it could not be sent as UTF-8.
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.cause = cause or _CAUSES.get(status, "internal")
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers["Retry-After"] = str(retry_after_s or DEFAULT_RETRY_AFTER_S)

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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# gRPC status from a worker -> (HTTP status, metric cause). Anything else is a 500.
_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "worker_invalid_argument"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "worker_busy"),
    grpc.StatusCode.UNAVAILABLE: (503, "worker_unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (500, "worker_failed_precondition"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNAUTHENTICATED: (500, "cluster_token"),
}


def worker_failure(
    status: int, message: str, *, cause: str, role: str, address: str, detail: str
) -> APIError:
    """An error a worker caused: `message` for the client, `detail` (and which worker) logged."""
    log.warning("%s worker %s: %s (%s)", role, address, detail, cause)
    return APIError(status, message, cause=cause)


def from_grpc(error: grpc.aio.AioRpcError, role: str, address: str) -> APIError:
    status, cause = _GRPC_STATUS.get(error.code(), (500, "worker_error"))
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = (
            f"The request timed out on the {role} worker; raise --request-timeout or shorten "
            "max_tokens."
        )
    elif error.code() == grpc.StatusCode.UNAUTHENTICATED:
        message = (
            f"The {role} worker rejected the cluster token; "
            "give the router and workers the same --cluster-token."
        )
    elif error.code() == grpc.StatusCode.UNAVAILABLE:
        message = f"The {role} worker is unavailable; retry the request."
    elif error.code() == grpc.StatusCode.UNIMPLEMENTED:
        message = (
            f"The {role} worker does not serve this call: it runs another dsaserve release; "
            "upgrade the workers before the routers."
        )
    elif error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the worker's words on the request
        message = f"{role} worker: {error.details()}"
    else:
        message = f"The {role} worker failed the request ({error.code().name.lower()})."
    detail = f"{error.code().name}: {error.details()}"
    return worker_failure(status, message, cause=cause, role=role, address=address, detail=detail)


def timeout_error(seconds: float, where: str) -> APIError:
    return APIError(
        504,
        f"The request timed out after {seconds:g} s {where}; "
        "raise --request-timeout or retry later.",
        cause="timeout",
    )


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One pydantic error as (message, param), phrased for someone fixing their request.

    The deepest one: of a union's members, the one that got furthest says what was meant
    (a list of text parts with a bad part, rather than "not a string").
    """
    first = max(errors, key=lambda e: len(e.get("loc", ())))
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
    if first.get("type") == "extra_forbidden":
        return unsupported_message(str(loc[-1]), param), param
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"Invalid value for '{param}': {msg}", param


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part
    )


ErrorShape = Callable[[APIError], dict[str, Any]]


def install_handlers(app: FastAPI, shapes: Mapping[str, ErrorShape] | None = None) -> None:
    """Route every error FastAPI can raise through the OpenAI error body, or on a path that
    `shapes` names (a path -> its API's error body) through that API's."""
    shapes = dict(shapes or {})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.failure = exc
        shape = shapes.get(request.url.path)
        if shape is None:
            return exc.response()
        return JSONResponse(shape(exc), status_code=exc.status, headers=exc.headers)

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
        # Starlette's 405 names the allowed methods in `Allow`; keep it.
        return await _api_error(
            request, APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await _api_error(request, APIError(500, "Internal router error; see its log."))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error response's body (the schema /openapi.json gives for each error status)."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: a field's value, an unknown or unsupported field, or a prompt over "
    "the context",
    401: "Missing or invalid API key",
    404: "Unknown model",
    413: "Request body over --max-request-bytes",
    429: "At capacity (admission queue full, or this API key's limit)",
    503: "No live worker can serve the request",
    504: "The request did not finish within --request-timeout",
    "default": "Internal error",
}


def error_responses(
    *statuses: int, body: type[BaseModel] = ErrorBody
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for these error statuses (and a 500 as the default), so /openapi.json
    lists what the router really sends: its own error body (`body`: another API's shape of it),
    never FastAPI's 422."""
    responses: dict[int | str, dict[str, Any]] = {}
    keys: tuple[int | str, ...] = (*statuses, "default")
    for status in keys:
        response: dict[str, Any] = {"model": body, "description": _DESCRIPTIONS[status]}
        if status in (429, 503):
            response["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before retrying",
                    "schema": {"type": "integer"},
                }
            }
        responses[status] = response
    return responses
