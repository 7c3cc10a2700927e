"""Turning a request's events into an HTTP answer: an SSE stream, or one JSON object.

Both paths notice a client that goes away and close the event generator, which cancels the
Decode call and aborts the prefill (see pd.py); one that leaves before its answer starts
(tokenizing, queued for admission, in prefill) is noticed by `cancelled_on_disconnect`. A whole
answer is written a choice at a time (`JSONParts`), so the router never holds a large one whole.
A `StreamWriter` writes one API's events: OpenAI's (`OpenAIStream`) sends errors after the 200
went out as `data: {"error": ...}` followed by `data: [DONE]`, as vLLM does, in valid JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, Protocol

from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dsaserve.services.router.api.envelopes import Reply
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.fanout import Indexed
from dsaserve.services.router.metrics import CLIENT_CLOSED
from dsaserve.services.router.pd import Event

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# Where Python's str.splitlines() breaks a line, besides what JSON escapes anyway (\n, \r and the
# other control characters): a client that splits the stream with it (httpx's aiter_lines) would
# cut a chunk in two, so these go out as \u escapes.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


# One encoder for every chunk: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def sse(payload: dict[str, Any]) -> bytes:
    text = _ENCODER.encode(payload)
    if not text.isascii():  # (a flag of the string: most chunks skip the translation)
        text = text.translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


def client_closed() -> APIError:
    return APIError(
        CLIENT_CLOSED,
        "The client closed the connection before the answer was complete.",
        cause="client_disconnect",
    )


class StreamWriter(Protocol):
    """An API's SSE bytes for one request's stream."""

    def opening(self) -> bytes: ...

    async def event(self, index: int, event: Event) -> bytes:
        """What choice `index`'s event adds (b"" for nothing yet); a writer may await here
        (the Responses API stores a response before saying it is complete)."""
        ...

    def error(self, error: APIError) -> bytes:
        """An error after the 200 went out."""
        ...

    def closing(self) -> bytes: ...


class OpenAIStream:
    """OpenAI's chunks: `data: {chunk}` lines, an error as `data: {"error": ...}`, then
    `data: [DONE]`."""

    def __init__(self, reply: Reply) -> None:
        self._reply = reply

    def opening(self) -> bytes:
        return b"".join(sse(chunk) for chunk in self._reply.opening_chunks())

    async def event(self, index: int, event: Event) -> bytes:
        return b"".join(sse(chunk) for chunk in self._reply.chunks(index, event))

    def error(self, error: APIError) -> bytes:
        return sse(error.body())

    def closing(self) -> bytes:
        return DONE


class EventStream(StreamingResponse):
    """`text/event-stream` over a request's events; `on_close` runs once, however it ends."""

    def __init__(
        self,
        events: AsyncGenerator[Indexed, None],
        writer: StreamWriter,
        state: State,
        on_close: Callable[[], None],
    ) -> None:
        self._events = events
        self._state = state
        self._on_close = on_close
        self._complete = False
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._body(writer), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette stops iterating when the client disconnects but closes neither generator.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._events.aclose()
            if not self._complete and getattr(self._state, "failure", None) is None:
                self._state.failure = client_closed()
            self._on_close()

    async def _body(self, writer: StreamWriter) -> AsyncIterator[bytes]:
        try:
            if opening := writer.opening():
                yield opening
            async for index, event in self._events:
                if data := await writer.event(index, event):
                    yield data
        except APIError as e:
            self._state.failure = e
            yield writer.error(e)
        except Exception as e:  # a bug must still end the stream in a way clients understand
            log.exception("stream failed")
            self._state.failure = APIError(500, f"Internal router error: {type(e).__name__}: {e}")
            yield writer.error(self._state.failure)
        self._complete = True
        yield writer.closing()


async def answer(
    events: AsyncGenerator[Indexed, None],
    feed: Callable[[int, Event], object],
    build: Callable[[], dict[str, Any] | Iterator[bytes]],
    request: Request,
) -> Response:
    """The whole answer as one JSON object: every event to `feed`, then `build()`'s body (an
    object, or its JSON in parts, written as they come: `JSONParts`); stops the generation if
    the client disconnects."""
    collecting = asyncio.ensure_future(_collect(events, feed))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        # Bounded: the generation's gRPC calls carry the request's deadline.
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            await asyncio.wait({collecting})  # its cleanup never awaits, so this returns at once
    if collecting.cancelled():
        request.state.failure = client_closed()
        return Response(status_code=CLIENT_CLOSED)
    collecting.result()  # re-raises an APIError from the flow
    body = build()
    return JSONResponse(body) if isinstance(body, dict) else JSONParts(body)


class JSONParts(StreamingResponse):
    """A JSON body written part by part as `parts` makes them, the event loop free between
    two: the router never holds a large answer whole, nor stalls other streams to encode it."""

    def __init__(self, parts: Iterator[bytes]) -> None:
        super().__init__(_one_at_a_time(parts), media_type="application/json")


async def _one_at_a_time(parts: Iterator[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
        await asyncio.sleep(0)  # (let other requests run before the next part is made)


async def _collect(
    events: AsyncGenerator[Indexed, None], feed: Callable[[int, Event], object]
) -> None:
    # The same calls as a stream makes, so both parse the reply the same way.
    async for index, event in events:
        feed(index, event)


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(request: Request) -> AsyncIterator[None]:
    """Cancel what runs inside when the client disconnects, as `client_closed()`.

    For the work before an answer starts (tokenizing, waiting for admission, prefill): nothing
    reads from the connection then, so without this a client that left stays queued, or keeps
    its prompt computing, to the end. The request's body must have been read."""
    task = asyncio.current_task()
    assert task is not None
    inside, gone = True, False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        if inside:
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # this cancellation was ours, and ends here
        raise client_closed() from None
    finally:
        inside = False
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
