"""Many Decode requests over one DecodeStream: the worker's `multiplex` and the router's
`WorkerDecodeStream`, over real gRPC on loopback.

Each request must see exactly what its own Decode call would (its chunks in order, then EOF or
the call's status), whatever the others on the stream do; a cancel, a deadline or the stream's
end must run the request's cleanup at the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import pytest_asyncio

from dsaserve.services.auth import ClusterTokenCheck, token_metadata
from dsaserve.services.decode.multiplex import CallContext, multiplex
from dsaserve.services.router.decode_stream import DecodeHandle, WorkerDecodeStream
from dsaserve.services.rpc import grpc_api, pb

TOKEN = "stream-token"
WAIT_S = 10.0


class ByRequestId(grpc_api.DecodeServicer):
    """Decode behaviour from the request id's prefix: `ok-N[-i]` sends N chunks and done,
    `bad` aborts INVALID_ARGUMENT, `boom` raises, `hold` waits until cancelled, `gate` sends
    one chunk once `gate` is set. Records what started (`gate` requests are waiting on it by
    then: nothing awaits between), what was cancelled and each message's size."""

    def __init__(self) -> None:
        self.started: set[str] = set()
        self.cancelled: set[str] = set()
        self.message_sizes: list[int] = []
        self.gate = asyncio.Event()
        self.draining = asyncio.Event()  # the worker's `stopping`
        self.mute = False  # read the router's requests, never answer (a wedged worker)

    async def Decode(
        self, request: pb.DecodeRequest, context: CallContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        rid = request.request_id
        kind, *fields = rid.split("-")
        self.started.add(rid)
        try:
            if kind == "bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid} is bad")
            if kind == "boom":
                raise RuntimeError(f"{rid} exploded")
            if kind == "hold":
                await asyncio.Event().wait()
            if kind == "gate":
                await self.gate.wait()
            for i in range(int(fields[0]) if kind == "ok" else 1):
                yield pb.DecodeResponse(chunk=pb.DecodeChunk(token_ids=[i], text=f"{rid}:{i}"))
                await asyncio.sleep(0)
            done = pb.DecodeDone(finish_reason=pb.FINISH_REASON_STOP)
            yield pb.DecodeResponse(done=done)
        except asyncio.CancelledError:
            self.cancelled.add(rid)
            raise

    async def DecodeStream(
        self, requests: AsyncIterator[pb.DecodeStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeStreamResponse]:
        if self.mute:
            async for _ in requests:
                pass
            return
        async for message in multiplex(self.Decode, requests, context, self.draining):
            self.message_sizes.append(len(message.updates))
            yield message


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[ByRequestId, grpc.aio.Server, grpc.aio.Channel]]:
    servicer = ByRequestId()
    server = grpc.aio.server(interceptors=[ClusterTokenCheck(TOKEN)])
    grpc_api.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, server, channel
    await channel.close()
    await server.stop(grace=None)


def _stream(channel: grpc.aio.Channel, token: str = TOKEN) -> WorkerDecodeStream:
    return WorkerDecodeStream(channel, token_metadata(token), "test-worker")


def _start(stream: WorkerDecodeStream, rid: str, timeout_s: float = WAIT_S) -> DecodeHandle:
    return stream.start(pb.DecodeRequest(request_id=rid), timeout_s)


async def _texts(handle: DecodeHandle) -> list[str]:
    """A request's chunk texts up to its done, then checks the stream says EOF."""
    texts = []
    while True:
        response = await asyncio.wait_for(handle.read(), WAIT_S)
        assert response is not grpc.aio.EOF, "EOF before done"
        if response.HasField("done"):
            assert await asyncio.wait_for(handle.read(), WAIT_S) is grpc.aio.EOF
            return texts
        texts.append(response.chunk.text)


async def _status(handle: DecodeHandle) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        while await asyncio.wait_for(handle.read(), WAIT_S) is not grpc.aio.EOF:
            pass
    return failed.value.code()


async def _until(condition: Callable[[], object], what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.asyncio
async def test_requests_share_a_stream_and_each_sees_its_own_chunks(served) -> None:
    servicer, _, channel = served
    stream = _stream(channel)
    lengths = {f"ok-{n}": n for n in (1, 3, 7, 12)}
    lengths |= {f"ok-{n}-{i}": n for i, n in enumerate((5, 2, 9, 4, 6, 8))}
    handles = {rid: _start(stream, rid) for rid in lengths}
    results = await asyncio.gather(*(_texts(h) for h in handles.values()))
    for (rid, n), texts in zip(lengths.items(), results, strict=True):
        assert texts == [f"{rid}:{i}" for i in range(n)]
    # every chunk, done and end crossed one stream, several to a message
    updates = sum(n + 2 for n in lengths.values())
    assert sum(servicer.message_sizes) == updates
    assert len(servicer.message_sizes) < updates
    stream.close()


@pytest.mark.asyncio
async def test_a_step_for_many_requests_is_one_message(served) -> None:
    """Requests that produce at the same moment (one engine step) leave in one message."""
    servicer, _, channel = served
    stream = _stream(channel)
    handles = [_start(stream, f"gate-{i}") for i in range(40)]
    await _until(lambda: len(servicer.started) == 40, "40 requests waiting")
    servicer.message_sizes.clear()
    servicer.gate.set()
    for handle in handles:
        assert len(await _texts(handle)) == 1
    # 40 chunks, 40 dones, 40 ends; the 40 chunks of the step leave together
    assert sum(servicer.message_sizes) == 120
    assert servicer.message_sizes[0] >= 40, servicer.message_sizes
    stream.close()


@pytest.mark.asyncio
async def test_one_request_failing_leaves_the_others_running(served) -> None:
    servicer, _, channel = served
    stream = _stream(channel)
    ok = _start(stream, "ok-6")
    bad, boom = _start(stream, "bad"), _start(stream, "boom")
    assert await _status(bad) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _status(boom) == grpc.StatusCode.INTERNAL
    assert await _status(bad) == grpc.StatusCode.INVALID_ARGUMENT  # (as a call's later reads)
    assert await _texts(ok) == [f"ok-6:{i}" for i in range(6)]
    assert await _texts(_start(stream, "ok-2")) == ["ok-2:0", "ok-2:1"]  # the stream still works
    assert not stream.broken
    stream.close()


@pytest.mark.asyncio
async def test_cancel_and_deadline_end_the_request_at_the_worker(served) -> None:
    servicer, _, channel = served
    stream = _stream(channel)
    held, timed = _start(stream, "hold-1"), _start(stream, "hold-2", timeout_s=0.2)
    other = _start(stream, "hold-3")
    assert await _status(timed) == grpc.StatusCode.DEADLINE_EXCEEDED
    await _until(lambda: "hold-2" in servicer.cancelled, "its cleanup to run at the worker")
    held.cancel()
    await _until(lambda: "hold-1" in servicer.cancelled, "the cancel to reach the worker")
    assert "hold-3" not in servicer.cancelled
    held.cancel()  # twice: a no-op
    assert await _texts(_start(stream, "ok-3")) == ["ok-3:0", "ok-3:1", "ok-3:2"]
    stream.close()  # the router leaving ends what still runs there
    await _until(lambda: "hold-3" in servicer.cancelled, "the stream's end to cancel hold-3")
    assert await _status(other) == grpc.StatusCode.CANCELLED


@pytest.mark.asyncio
async def test_a_broken_stream_fails_every_request_on_it(served) -> None:
    servicer, server, channel = served
    stream = _stream(channel)
    handles = [_start(stream, f"hold-{i}") for i in range(5)]
    await _until(lambda: len(servicer.started) == 5, "the five to start at the worker")
    await server.stop(grace=None)  # the worker goes away
    codes = {await _status(h) for h in handles}
    assert codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, codes
    assert stream.broken
    await _until(lambda: len(servicer.cancelled) == 5, "the worker to cancel all five")


@pytest.mark.asyncio
async def test_a_stream_without_the_cluster_token_is_refused(served) -> None:
    _, _, channel = served
    stream = _stream(channel, token="wrong")
    assert await _status(_start(stream, "ok-1")) == grpc.StatusCode.UNAUTHENTICATED
    assert stream.broken


@pytest.mark.asyncio
async def test_the_routers_deadline_holds_against_a_worker_that_never_answers(served) -> None:
    servicer, _, channel = served
    servicer.mute = True
    stream = _stream(channel)
    handle = _start(stream, "ok-1", timeout_s=0.3)
    assert await _status(handle) == grpc.StatusCode.DEADLINE_EXCEEDED
    # a timeout past DecodeStart.timeout_ms's range is sent as its largest value
    _start(stream, "ok-2", timeout_s=1e10)  # (raised ValueError before the clamp)
    assert "ok-2" in stream._handles
    stream.close()


@pytest.mark.asyncio
async def test_a_stopping_worker_refuses_new_requests_and_ends_the_stream(served) -> None:
    servicer, _, channel = served
    stream = _stream(channel)
    running = _start(stream, "gate-1")
    await _until(lambda: servicer.started == {"gate-1"}, "the request to wait")
    servicer.draining.set()
    assert await _status(_start(stream, "ok-1")) == grpc.StatusCode.UNAVAILABLE  # retryable
    servicer.gate.set()
    assert len(await _texts(running)) == 1  # what ran finishes
    await _until(lambda: stream.broken, "the worker to end the stream")


@pytest.mark.asyncio
async def test_a_duplicate_request_id_is_refused_and_leaves_the_first_running(served) -> None:
    servicer, _, channel = served
    stream = _stream(channel)
    first = _start(stream, "gate-1")
    assert await _status(_start(stream, "gate-1")) == grpc.StatusCode.ALREADY_EXISTS
    await _until(lambda: servicer.started == {"gate-1"}, "the first to wait")
    servicer.gate.set()
    assert len(await _texts(first)) == 1
    stream.close()


@pytest.mark.asyncio
async def test_a_request_cancelled_before_it_ran_lets_the_stream_end() -> None:
    """A cancel read in the same turn as its start (the task never ran): the stream still ends
    once the router closes its side (the request no longer counts as running)."""
    servicer = ByRequestId()
    start = pb.DecodeStreamRequest(
        start=pb.DecodeStart(request=pb.DecodeRequest(request_id="hold-A"))
    )

    async def requests() -> AsyncIterator[pb.DecodeStreamRequest]:
        yield start
        yield pb.DecodeStreamRequest(cancel="hold-A")

    async def serve() -> list[pb.DecodeStreamResponse]:
        return [m async for m in multiplex(servicer.Decode, requests(), None)]  # type: ignore[arg-type]

    messages = await asyncio.wait_for(serve(), WAIT_S)
    assert [u for m in messages for u in m.updates] == []  # (the router let it go)
