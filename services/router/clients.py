"""gRPC clients to the workers: one cached channel per address, the cluster token, in-flight counts.

Channels are created on first use (inside the event loop) and kept for the router's lifetime;
gRPC reconnects them by itself, with a short backoff cap so a restarted worker at the same
address is reachable again within seconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterator

import grpc

from services.auth import token_metadata
from services.connections import GrpcTLS, open_channel
from services.registry import WorkerRecord
from services.rpc import grpc_api, pb

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


class WorkerClients:
    def __init__(self, cluster_token: str, tls: GrpcTLS) -> None:
        self.metadata = token_metadata(cluster_token)
        self._tls = tls
        # Calls this router has open per worker id: the policies add it to the registry's load.
        self.inflight: collections.Counter[str] = collections.Counter()
        self._channels: dict[
            str, tuple[grpc.aio.Channel, grpc_api.PrefillStub, grpc_api.DecodeStub]
        ] = {}
        self._aborts: set[asyncio.Task[None]] = set()

    def _stubs(
        self, address: str
    ) -> tuple[grpc.aio.Channel, grpc_api.PrefillStub, grpc_api.DecodeStub]:
        if address not in self._channels:
            channel = open_channel(address, self._tls)
            self._channels[address] = (
                channel,
                grpc_api.PrefillStub(channel),
                grpc_api.DecodeStub(channel),
            )
        return self._channels[address]

    def prefill(self, address: str) -> grpc_api.PrefillStub:
        return self._stubs(address)[1]

    def decode(self, address: str) -> grpc_api.DecodeStub:
        return self._stubs(address)[2]

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
        stub = (
            self.prefill(worker.address)
            if worker.role == "prefill"
            else self.decode(worker.address)
        )
        try:
            await stub.Abort(
                pb.AbortRequest(request_id=request_id),
                timeout=ABORT_TIMEOUT_S,
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
        for channel, _, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
