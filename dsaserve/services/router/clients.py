"""gRPC clients to the workers: one cached channel per worker process (and on it one
DecodeStream per decode worker), the cluster token, in-flight counts.

Channels are created on first use (inside the event loop) and kept while the worker runs; gRPC
reconnects them by itself, with a short backoff cap. A worker restarted at the same address
writes a record with a new start time: its first call opens a fresh channel instead of waiting
out the old one's reconnect backoff.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterator

import grpc

from dsaserve.engine.load import step_deadline
from dsaserve.services.auth import token_metadata
from dsaserve.services.connections import GrpcTLS, open_channel
from dsaserve.services.registry import WorkerRecord
from dsaserve.services.router.decode_stream import WorkerDecodeStream
from dsaserve.services.rpc import grpc_api, pb

log = logging.getLogger(__name__)

# An Abort waits at least this, longer for a worker whose steps are slow (a loaded host).
ABORT_TIMEOUT_S = 5.0
ABORT_STEPS = 10
_Stubs = tuple[grpc.aio.Channel, grpc_api.PrefillStub, grpc_api.DecodeStub]


class WorkerClients:
    def __init__(self, cluster_token: str, tls: GrpcTLS) -> None:
        self.metadata = token_metadata(cluster_token)
        self._tls = tls
        # Calls this router has open per worker id: the policies add it to the registry's load.
        self.inflight: collections.Counter[str] = collections.Counter()
        # address -> (the start time of the worker it reaches, its channel and stubs)
        self._channels: dict[str, tuple[float, _Stubs]] = {}
        self._decode_streams: dict[str, WorkerDecodeStream] = {}  # by address
        self._aborts: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def _stubs(self, worker: WorkerRecord) -> _Stubs:
        known = self._channels.get(worker.address)
        if known is not None and known[0] != worker.started_at:  # another process there now
            task = asyncio.get_running_loop().create_task(known[1][0].close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            known = None
        if known is None:
            channel = open_channel(worker.address, self._tls)
            stubs = (channel, grpc_api.PrefillStub(channel), grpc_api.DecodeStub(channel))
            known = self._channels[worker.address] = (worker.started_at, stubs)
        return known[1]

    def prefill(self, worker: WorkerRecord) -> grpc_api.PrefillStub:
        return self._stubs(worker)[1]

    def decode(self, worker: WorkerRecord) -> grpc_api.DecodeStub:
        return self._stubs(worker)[2]

    def decode_stream(self, worker: WorkerRecord) -> WorkerDecodeStream:
        """This router's DecodeStream to `worker`, opened on first use and after a break."""
        channel = self._stubs(worker)[0]
        stream = self._decode_streams.get(worker.address)
        if stream is None or stream.broken or stream.channel is not channel:
            if stream is not None:
                stream.close()  # (a worker gone from that address: the channel closes anyway)
            stream = WorkerDecodeStream(channel, self.metadata, worker.address)
            self._decode_streams[worker.address] = stream
        return stream

    @contextlib.contextmanager
    def busy(self, worker_id: str) -> Iterator[None]:
        """Count one open call to `worker_id` for the balancing policies."""
        self.inflight[worker_id] += 1
        try:
            yield
        finally:
            self.inflight[worker_id] -= 1
            if self.inflight[worker_id] <= 0:
                del self.inflight[worker_id]

    def abort_later(self, worker: WorkerRecord, request_id: str) -> None:
        """Tell a worker to drop a request's state, without blocking the caller.

        Called from cleanup paths that may be running under cancellation (a client that went
        away), where awaiting would be interrupted; the task has its own deadline.
        """
        task = asyncio.get_running_loop().create_task(self._abort(worker, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, worker: WorkerRecord, request_id: str) -> None:
        stub = self.prefill(worker) if worker.role == "prefill" else self.decode(worker)
        try:
            await stub.Abort(
                pb.AbortRequest(request_id=request_id),
                timeout=step_deadline(ABORT_TIMEOUT_S, ABORT_STEPS, worker.load.step_ms),
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as e:
            # The worker's lease frees the state anyway; this only makes it sooner.
            log.warning(
                "Abort(%s) on %s worker %s failed: %s",
                request_id,
                worker.role,
                worker.address,
                e.code(),
            )

    async def close(self) -> None:
        """Let pending aborts finish (bounded), then close every channel."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)
        for stream in self._decode_streams.values():
            stream.close()
        self._decode_streams.clear()
        for _, (channel, _, _) in self._channels.values():
            await channel.close()
        self._channels.clear()
