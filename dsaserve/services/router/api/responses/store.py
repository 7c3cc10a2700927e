"""The Responses API's stored responses, in Redis under a TTL: what `previous_response_id`
continues from.

A stored response is its object as the client got it and the conversation behind it (the chat
messages its input became, without `instructions`, which a next request does not inherit, and
then its reply), one JSON value per key `dsaserve:response:<id>`, expiring `ttl_s` after it was
written. Every router of a deployment shares them through the registry's Redis, so a
conversation may continue on any router. While Redis is unreachable, a request that names a
previous response gets a 503, and a response that should be stored is served unstored (a
warning says so).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dsaserve.services.router.api.errors import APIError

log = logging.getLogger(__name__)

JSON = dict[str, Any]
KEY_PREFIX = "dsaserve:response:"
TIMEOUT_S = 5.0  # each Redis call's


@dataclass(frozen=True)
class StoredResponse:
    response: JSON  # the response object
    messages: list[JSON]  # the conversation: chat messages up to and including its reply


class ResponseStore:
    def __init__(self, redis_url: str, ttl_s: float) -> None:
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.ttl_s = ttl_s

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 when there is none (never stored, or expired); `param`:
        the request field that named it, for errors."""
        try:
            raw = await self._redis.get(KEY_PREFIX + response_id)
        except (RedisError, OSError) as e:
            raise APIError(
                503,
                f"The response store (Redis) is unreachable ({e}); retry the request.",
                param=param,
                cause="response_store",
            ) from None
        if raw is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found: it was never stored "
                f"(store: false) or it expired ({self.ttl_s:g} s after it was made).",
                param=param,
                code="response_not_found",
            )
        record = json.loads(raw)
        return StoredResponse(record["response"], record["messages"])

    async def put(self, stored: StoredResponse) -> None:
        record = {"response": stored.response, "messages": stored.messages}
        try:
            await self._redis.set(
                KEY_PREFIX + stored.response["id"],
                json.dumps(record, ensure_ascii=False),
                px=max(1, int(self.ttl_s * 1000)),
            )
        except (RedisError, OSError) as e:
            log.warning("response %s not stored: Redis unreachable (%s)", stored.response["id"], e)

    async def close(self) -> None:
        await self._redis.aclose()
