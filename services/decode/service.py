"""gRPC Decode service: reserve pages, pull the prefilled KV with one NIXL READ, decode, stream.

Every way out of a Decode call - done, error, the router cancelling the stream - leaves no
pages behind: the request is aborted in the engine unless it finished there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import redis.asyncio as aioredis

from engine.engine_loop import OutputQueue
from engine.llm_engine import KVPages, RequestError
from engine.sampling_params import SamplingParams
from services.rpc import grpc_api, pb
from services.transfer import TransferError, fetch_descriptor
from services.worker.convert import FINISH_REASONS, sampling_from_proto
from services.worker.process import RoleService, Worker, now_ms
from services.worker.settings import DecodeSettings

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.01  # how often a request waiting for free pages retries


class DecodeService(RoleService, grpc_api.DecodeServicer):
    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        assert isinstance(worker.settings, DecodeSettings)
        self.transfer_timeout = worker.settings.transfer_timeout
        self.redis = aioredis.Redis.from_url(
            worker.settings.redis_url, socket_timeout=5, socket_connect_timeout=5
        )
        self.peers: set[str] = set()

    def register(self, server: grpc.aio.Server) -> None:
        grpc_api.add_DecodeServicer_to_server(self, server)

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        w, rid, kv, start = self.w, request.request_id, request.kv, time.monotonic()
        if not rid or not request.HasField("kv"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and kv are required")
        if kv.layout_hash != w.layout_hash:
            w.metrics.fail("layout_mismatch")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: prefill worker {kv.worker_id} has layout "
                f"{kv.layout or kv.layout_hash}, "
                f"decode worker {w.worker_id} has layout {w.layout}; run both with the same model, "
                "dtype and --block-size",
            )
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = False
        try:
            outputs = OutputQueue()
            held = await self._reserve(request, params, outputs, context)
            peer = await self._peer(kv.agent_name, context)
            try:
                stats = await w.in_nixl_thread(
                    w.transfer.read,
                    peer,
                    {g: list(p.ids) for g, p in kv.pages.items()},
                    held.pages,
                    notify=rid.encode(),
                    timeout_s=self.transfer_timeout,
                )
            except TransferError as e:
                w.metrics.fail("transfer")
                log.warning("KV pull for %s from %s failed: %s", rid, kv.worker_id, e)
                self.peers.discard(peer)  # a restarted peer may reuse the name: refetch next time
                yield pb.DecodeResponse(
                    error=pb.DecodeError(
                        message=f"KV transfer from {kv.worker_id} failed: {e}", cause="transfer"
                    )
                )
                return
            w.metrics.transfer_bytes.inc(stats.bytes)
            w.metrics.transfer_seconds.observe(stats.seconds)
            await w.loop.run(lambda e: e.join(rid))
            async for out in w.loop.stream(rid, outputs):
                if out.finish_reason == "abort":
                    w.metrics.fail("aborted")
                    yield pb.DecodeResponse(
                        error=pb.DecodeError(message=f"request {rid} was aborted", cause="abort")
                    )
                    return
                yield pb.DecodeResponse(
                    chunk=pb.DecodeChunk(token_ids=out.new_token_ids, text=out.text)
                )
                w.metrics.tokens.labels(role="decode", kind="generated").inc(len(out.new_token_ids))
                if out.finished:
                    finished = True
                    w.metrics.requests.labels(role="decode", outcome="ok").inc()
                    w.metrics.latency.labels(role="decode").observe(time.monotonic() - start)
                    yield pb.DecodeResponse(
                        done=pb.DecodeDone(
                            finish_reason=FINISH_REASONS[out.finish_reason],
                            usage=pb.Usage(
                                prompt_tokens=out.prompt_tokens,
                                completion_tokens=out.completion_tokens,
                            ),
                        )
                    )
        finally:
            if not finished:  # error, abort or a cancelled stream: free whatever we reserved
                w.loop.call(lambda e: e.abort(rid))

    async def _reserve(
        self,
        request: pb.DecodeRequest,
        params: SamplingParams,
        outputs: OutputQueue,
        context: grpc.aio.ServicerContext,
    ) -> KVPages:
        """Pages for the request's KV; waits while the pools are full, up to the prefill lease."""
        w, rid = self.w, request.request_id
        prompt, first = list(request.prompt_token_ids), request.first_token_id
        deadline = time.monotonic() + max(0.0, (request.kv.lease_expires_unix_ms - now_ms()) / 1000)
        while True:
            try:
                held = await w.loop.run(lambda e: e.reserve(rid, prompt, first, params, outputs))
            except RequestError as e:
                w.metrics.fail("invalid_request")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if held is not None:
                return held
            if time.monotonic() > deadline:
                w.metrics.fail("no_kv_space")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode worker {w.worker_id} had no free KV pages before the prefill lease "
                    "ran out",
                )
            await asyncio.sleep(RESERVE_RETRY_S)

    async def _peer(self, agent: str, context: grpc.aio.ServicerContext) -> str:
        """Load the prefill agent's NIXL descriptor from the registry once."""
        if agent not in self.peers:
            try:
                descriptor = await fetch_descriptor(self.redis, agent)
            except (aioredis.RedisError, OSError) as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"registry unreachable: {e}")
            if descriptor is None:
                self.w.metrics.fail("peer_unknown")
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"prefill agent {agent} has no NIXL descriptor in the registry (worker gone?)",
                )
            try:
                await self.w.in_nixl_thread(self.w.transfer.add_peer, descriptor)
            except TransferError as e:
                self.w.metrics.fail("layout_mismatch")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            self.peers.add(agent)
        return agent
