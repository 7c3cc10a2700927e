"""The Responses API's stored responses, in Redis under a TTL: what `previous_response_id`
continues from, what `GET /v1/responses/{id}` and its `input_items` return.

A stored response is its object as the client got it, the input items of its request (with
their ids), the conversation behind it (the chat messages its input became, without
`instructions`, which a next request does not inherit, and then its reply), and its owner: the
tenant of the API key that made it (tenancy.py). One JSON value per key
`dsaserve:response:<id>`, expiring `ttl_s` after it was written. Every router of a deployment
shares them through the registry's Redis, so a conversation may continue on any router. A
response is found only by its owner: another key gets the same 404 as for an id never stored.
While Redis is unreachable, a request that names a stored response gets a 503, and a response
that should be stored is served unstored (a warning says so).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dsaserve.services import bounded_json
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.tenancy import same_tenant

log = logging.getLogger(__name__)

JSON = dict[str, Any]
KEY_PREFIX = "dsaserve:response:"
TIMEOUT_S = 5.0  # each Redis call's
# What a stored value may be when read back (it is ours, but Redis may be written by others).
MAX_BYTES = 64 << 20
MAX_DEPTH = 512


@dataclass(frozen=True)
class StoredResponse:
    response: JSON  # the response object
    messages: list[JSON]  # the conversation: chat messages up to and including its reply
    input_items: list[JSON]  # the request's input as items, each with its id
    owner: str | None  # the tenant that made it (None: a router without API keys)


class ResponseStore:
    def __init__(self, redis_url: str, ttl_s: float) -> None:
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.ttl_s = ttl_s

    async def get(
        self, response_id: str, owner: str | None, param: str | None = None
    ) -> StoredResponse:
        """`owner`'s stored response; 404 when there is none (never stored, expired, deleted,
        or another tenant's); `param`: the request field that named it, for errors."""
        raw = await self._call(self._redis.get(KEY_PREFIX + response_id), param)
        record = None
        if raw is not None:
            try:
                record = bounded_json.loads(raw, MAX_BYTES, MAX_DEPTH)
            except ValueError as e:
                log.warning("stored response %s is unreadable: %s", response_id, e)
        if not isinstance(record, dict) or not same_tenant(record.get("owner"), owner):
            raise _not_found(response_id, self.ttl_s, param)
        return StoredResponse(
            record["response"], record["messages"], record.get("input_items", []), owner
        )

    async def put(self, stored: StoredResponse) -> None:
        record = {
            "response": stored.response,
            "messages": stored.messages,
            "input_items": stored.input_items,
            "owner": stored.owner,
        }
        try:
            await self._redis.set(
                KEY_PREFIX + stored.response["id"],
                json.dumps(record, ensure_ascii=False),
                px=max(1, int(self.ttl_s * 1000)),
            )
        except (RedisError, OSError) as e:
            log.warning("response %s not stored: Redis unreachable (%s)", stored.response["id"], e)

    async def delete(self, response_id: str, owner: str | None) -> None:
        """Delete `owner`'s stored response; 404 as `get` when it has none of that id."""
        await self.get(response_id, owner)
        await self._call(self._redis.delete(KEY_PREFIX + response_id), None)

    async def _call(self, command: Any, param: str | None) -> Any:
        try:
            return await command
        except (RedisError, OSError) as e:
            raise APIError(
                503,
                f"The response store (Redis) is unreachable ({e}); retry the request.",
                param=param,
                cause="response_store",
            ) from None

    async def close(self) -> None:
        await self._redis.aclose()


def _not_found(response_id: str, ttl_s: float, param: str | None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found: it was never stored (store: false), "
        f"it expired ({ttl_s:g} s after it was made) or was deleted.",
        param=param,
        code="response_not_found",
    )
