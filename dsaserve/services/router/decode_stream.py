"""The router's Decode calls: many requests over one DecodeStream per decode worker.

A decode worker sends one message a step for all of this router's requests on it (see the
DecodeStream RPC in proto/dsaserve.proto) instead of one per request: the router's gRPC cost
per token falls by the batch's size. `DecodeHandle` reads like the Decode call it replaces:
`read()` gives the request's next DecodeResponse, `grpc.aio.EOF` once it ended OK, or raises
the `grpc.aio.AioRpcError` that call would have raised; `cancel()` stops the request at the
worker (which frees its pages, as for a cancelled call). A stream that breaks (the worker died
or closed it, its connection dropped) fails every request on it with its status; the next
request opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from dsaserve.services.rpc import grpc_api, pb

log = logging.getLogger(__name__)
MAX_TIMEOUT_MS = (1 << 32) - 1  # DecodeStart.timeout_ms is a uint32 (~49.7 days)

# what a handle queues (a string: grpc.aio.EOFType exists only in grpc's type stubs)
_Item: TypeAlias = "pb.DecodeResponse | grpc.aio.EOFType | grpc.aio.AioRpcError"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call ending with this status raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status(end: pb.DecodeEnd) -> grpc.aio.EOFType | grpc.aio.AioRpcError:
    if end.code == grpc.StatusCode.OK.value[0]:
        return grpc.aio.EOF
    return rpc_error(_STATUS_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.details)


class DecodeHandle:
    """One request on a worker's DecodeStream. Its deadline is the router's too (one timer,
    as the call's own timeout was): a worker that never answers cannot hold a read past it."""

    __slots__ = ("request_id", "_stream", "_items", "_ended", "_timer")

    def __init__(self, request_id: str, stream: WorkerDecodeStream, timeout_s: float) -> None:
        self.request_id = request_id
        self._stream = stream
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._ended = False  # the last item is queued: nothing to cancel at the worker
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    async def read(self) -> pb.DecodeResponse | grpc.aio.EOFType:
        item = await self._items.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._items.put_nowait(item)  # (a later read raises it again, as a call's would)
            raise rpc_error(item.code(), item.details() or "")  # (a fresh one: no shared traceback)
        if item is grpc.aio.EOF:
            self._items.put_nowait(item)
        return item

    def cancel(self) -> None:
        """Stop the request at the worker; a no-op once it has ended."""
        if not self._ended:
            self._ended = True
            self._timer.cancel()
            self._stream.cancel(self.request_id)

    def _put(self, item: _Item) -> None:
        self._items.put_nowait(item)

    def _end(self, item: grpc.aio.EOFType | grpc.aio.AioRpcError) -> None:
        self._ended = True
        self._timer.cancel()
        self._items.put_nowait(item)

    def _expire(self) -> None:
        if not self._ended:
            self.cancel()
            self._items.put_nowait(
                rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            )


class WorkerDecodeStream:
    """This router's DecodeStream to one decode worker, on `channel`."""

    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], address: str
    ) -> None:
        self.channel, self.address = channel, address
        self.broken = False
        self._handles: dict[str, DecodeHandle] = {}
        self._outgoing: asyncio.Queue[pb.DecodeStreamRequest | None] = asyncio.Queue()
        stub = grpc_api.DecodeStub(channel)
        self._call = stub.DecodeStream(self._requests(), metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def start(self, request: pb.DecodeRequest, timeout_s: float) -> DecodeHandle:
        """Start `request` on the worker; it ends DEADLINE_EXCEEDED after `timeout_s`."""
        assert not self.broken
        rid = request.request_id
        handle = DecodeHandle(rid, self, timeout_s)
        if rid in self._handles:  # (the router's ids are unique: a bug, refused here alone)
            handle._end(rpc_error(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running"))
            return handle
        timeout_ms = min(max(1, round(timeout_s * 1000)), MAX_TIMEOUT_MS)
        message = pb.DecodeStreamRequest(
            start=pb.DecodeStart(request=request, timeout_ms=timeout_ms)
        )
        self._handles[rid] = handle
        self._outgoing.put_nowait(message)
        return handle

    def cancel(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None and not self.broken:
            self._outgoing.put_nowait(pb.DecodeStreamRequest(cancel=request_id))

    def close(self) -> None:
        """End the stream; the worker cancels whatever still runs on it."""
        self._outgoing.put_nowait(None)
        self._call.cancel()

    async def _requests(self) -> AsyncIterator[pb.DecodeStreamRequest]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    async def _read(self) -> None:
        handles = self._handles
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the decode worker ended the stream")
        try:
            async for message in self._call:
                for update in message.updates:
                    handle = handles.get(update.request_id)
                    if handle is None:  # cancelled here: the worker has not seen that yet
                        continue
                    if update.HasField("response"):
                        handle._put(update.response)
                    else:
                        del handles[update.request_id]
                        handle._end(_status(update.end))
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed the stream")
        except Exception as e:  # (a bug, or a message gRPC could not decode)
            log.exception("decode stream to %s failed", self.address)
            error = rpc_error(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self.broken = True
            self.close()  # (ends the request generator; a no-op on a call already over)
            if handles:
                log.warning(
                    "decode stream to %s broke (%s) with %d requests on it",
                    self.address,
                    error.code().name,
                    len(handles),
                )
            for handle in handles.values():
                handle._end(error)
            handles.clear()
