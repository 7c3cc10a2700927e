"""Many Decode calls over one gRPC stream (the DecodeStream RPC, proto/dsaserve.proto).

`multiplex` serves a DecodeStream with a servicer's own per-request `Decode` generator: each
started request runs it as a task with a `RequestContext` in place of its call's context, and a
cancel (or the stream's end) cancels that task as cancelling a Decode call would, so the
request's cleanup is the one Decode already has. Whatever the tasks produced since the last
write leaves in one message: while a write waits for the router, the next batch grows, in
practice one message a step, so gRPC's cost per message is paid once a step rather than once a
token per request.

Each request keeps its own deadline (`DecodeStart.timeout_ms`, and the router's on its side). A
stopping worker refuses new requests on its streams (UNAVAILABLE, which the router retries on
another worker) and ends a stream once its last request has ended. A router needs decode
workers that serve DecodeStream (an older one answers UNIMPLEMENTED): upgrade workers first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import NoReturn, TypeAlias

import grpc

from dsaserve.services.rpc import pb

log = logging.getLogger(__name__)
# Updates in one message at most: a batch stays far below the router's message size limit
# (connections.MAX_MESSAGE_BYTES) even with top-20 logprobs on several tokens an update.
MAX_UPDATES = 1024


class RequestAborted(Exception):
    """A request ended with a status, as `context.abort` ends a call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class RequestContext:
    """What a per-request Decode generator uses of its call's context, for one request of a
    stream: the stream's metadata, and `abort`, which ends only this request."""

    def __init__(self, stream: grpc.aio.ServicerContext) -> None:
        self._stream = stream

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...] | None:
        return self._stream.invocation_metadata()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise RequestAborted(code, details)


# A per-request Decode generator's context: its call's, or its request's on a DecodeStream.
CallContext: TypeAlias = grpc.aio.ServicerContext | RequestContext
PerRequest = Callable[[pb.DecodeRequest, CallContext], AsyncIterator[pb.DecodeResponse]]


def _end(request_id: str, code: grpc.StatusCode, details: str = "") -> pb.DecodeUpdate:
    return pb.DecodeUpdate(
        request_id=request_id, end=pb.DecodeEnd(code=code.value[0], details=details)
    )


async def multiplex(
    decode: PerRequest,
    requests: AsyncIterable[pb.DecodeStreamRequest],
    context: grpc.aio.ServicerContext,
    draining: asyncio.Event | None = None,
) -> AsyncIterator[pb.DecodeStreamResponse]:
    """Serve one DecodeStream; ends when the router has closed its side and every request
    has ended, or once `draining` is set (the worker is shutting down: new requests are
    refused UNAVAILABLE, which the router retries elsewhere) and every request has ended. If
    the stream goes (the router cancels it or dies), every request is cancelled."""
    outbox: asyncio.Queue[pb.DecodeUpdate | None] = asyncio.Queue()  # None: the stream is over
    running: dict[str, asyncio.Task[None]] = {}
    request_context = RequestContext(context)

    async def run(start: pb.DecodeStart) -> None:
        rid = start.request.request_id
        end = _end(rid, grpc.StatusCode.OK)
        try:
            async with asyncio.timeout(start.timeout_ms / 1000 if start.timeout_ms else None):
                async for response in decode(start.request, request_context):
                    outbox.put_nowait(pb.DecodeUpdate(request_id=rid, response=response))
        except RequestAborted as e:
            end = _end(rid, e.code, e.details)
        except TimeoutError:
            end = _end(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as e:  # a bug in one request must not end the others
            log.exception("decode of %s failed", rid)
            end = _end(rid, grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        outbox.put_nowait(end)  # (not after a cancel: the router has let the request go)

    def started(rid: str, task: asyncio.Task[None]) -> None:
        running[rid] = task
        # (a callback, not run's own cleanup: a task cancelled before its first step runs none)
        task.add_done_callback(lambda _: running.pop(rid, None))

    async def all_ended() -> None:
        while running:
            await asyncio.wait(set(running.values()))
        outbox.put_nowait(None)

    async def read() -> None:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "start":
                rid = message.start.request.request_id
                if draining is not None and draining.is_set():
                    outbox.put_nowait(
                        _end(rid, grpc.StatusCode.UNAVAILABLE, "the decode worker is stopping")
                    )
                elif rid in running:
                    outbox.put_nowait(
                        _end(rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running")
                    )
                else:
                    started(rid, asyncio.create_task(run(message.start)))
            elif kind == "cancel" and (task := running.get(message.cancel)) is not None:
                task.cancel()
        await all_ended()  # the router sends nothing more: end after the last request

    async def drain() -> None:
        assert draining is not None
        await draining.wait()
        await all_ended()

    helpers = [asyncio.create_task(read())]
    if draining is not None:
        helpers.append(asyncio.create_task(drain()))

    def helper_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            outbox.put_nowait(None)  # a broken request stream (or a bug) ends this stream too

    for helper in helpers:
        helper.add_done_callback(helper_done)
    try:
        while (update := await outbox.get()) is not None:
            updates = [update]
            while (
                len(updates) < MAX_UPDATES
                and not outbox.empty()
                and (update := outbox.get_nowait()) is not None
            ):
                updates.append(update)
            yield pb.DecodeStreamResponse(updates=updates)
            if update is None:
                break
        for helper in helpers:  # re-raise what broke it, if anything did
            if helper.done() and not helper.cancelled() and (error := helper.exception()):
                raise error
    finally:
        for helper in helpers:
            helper.cancel()
        for task in list(running.values()):
            task.cancel()  # each runs its Decode's cleanup: no pages stay behind
