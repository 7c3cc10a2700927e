"""The cluster token: a shared secret every internal gRPC call carries in its metadata.

Workers reject calls without it (UNAUTHENTICATED); the router sends it on every call.
The comparison takes constant time, so its duration says nothing about how much matched.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

TOKEN_METADATA_KEY = "x-dsaserve-cluster-token"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token`."""
    return ((TOKEN_METADATA_KEY, token),)


class ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """Server interceptor: calls without the right token end with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def reject(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY} metadata"
            )

        self._reject = reject

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,  # grpc.HandlerCallDetails
    ) -> Any:  # grpc.RpcMethodHandler
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = metadata.get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:

            async def reject_stream(
                request: object, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[None]:
                await self._reject(request, context)
                yield  # pragma: no cover - abort raises

            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(reject_stream)
            return grpc.unary_stream_rpc_method_handler(reject_stream)
        return grpc.unary_unary_rpc_method_handler(self._reject)
