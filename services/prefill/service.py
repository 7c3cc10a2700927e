"""gRPC Prefill service.

A request's KV stays pinned after its first token until one of: the decode worker's NIXL
READ notification (the normal path), an Abort, or the lease running out. Each frees it once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.engine import RequestError
from services.rpc import grpc_api, pb
from services.worker import FINISH_REASONS, Worker, now_ms, sampling_from_proto

log = logging.getLogger(__name__)
POLL_S = 0.01   # how often NIXL notifications and leases are checked


class PrefillService(grpc_api.PrefillServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.leases: dict[str, float] = {}   # request id -> monotonic deadline of its held KV

    def register(self, server: grpc.aio.Server) -> None:
        grpc_api.add_PrefillServicer_to_server(self, server)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        w, rid, start = self.w, request.request_id, time.monotonic()
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        queue = w.loop.subscribe(rid)
        try:
            await w.loop.run(lambda e: e.add_request(rid, prompt, params, prefill_only=True))
        except RequestError as e:
            w.loop.unsubscribe(rid)
            w.metrics.fail("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            out = await anext(w.loop.stream(rid, queue))
            held = await w.loop.run(lambda e: e.held_kv(rid)) if out.finish_reason is None else None
        except asyncio.CancelledError:   # the router gave up: nobody will read this KV
            w.loop.call(lambda e: e.abort(rid))
            raise
        if out.finish_reason == "abort":
            w.metrics.fail("aborted")
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted during prefill")
        w.metrics.tokens.labels(role="prefill", kind="prompt").inc(len(prompt))
        w.metrics.latency.labels(role="prefill").observe(time.monotonic() - start)
        w.metrics.requests.labels(role="prefill", outcome="ok").inc()
        response = pb.PrefillResponse(
            first_token_id=out.new_token_ids[0], text=out.text, finish_reason=FINISH_REASONS[out.finish_reason],
            usage=pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens))
        if held is not None:
            lease_s = w.args.lease_seconds
            self.leases[rid] = time.monotonic() + lease_s
            response.kv.CopyFrom(pb.KVHandle(
                worker_id=w.worker_id, agent_name=w.transfer.agent_name, layout_hash=w.layout_hash, layout=w.layout,
                blocks={g: pb.BlockIds(ids=ids) for g, ids in held.units.items()}, num_tokens=held.num_tokens,
                lease_expires_unix_ms=now_ms() + int(lease_s * 1000)))
        return response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        self.leases.pop(rid, None)
        return pb.AbortResponse(found=await self.w.loop.run(lambda e: e.abort(rid)))

    async def Health(self, request, context) -> pb.HealthResponse:
        return self.w.health_response()

    async def Load(self, request, context) -> pb.LoadResponse:
        return self.w.load_response()

    async def background(self) -> None:
        """Free held KV when its reader says it is done, or when its lease runs out."""
        while True:
            await asyncio.sleep(POLL_S)
            done = [msg.decode(errors="replace") for _, msg in await self.w.in_nixl_thread(self.w.transfer.notifications)]
            now = time.monotonic()
            expired = [rid for rid, deadline in self.leases.items() if deadline < now]
            for rid in expired:
                log.warning("KV lease of %s expired before a decode worker read it; freeing", rid)
                self.w.metrics.fail("lease_expired")
            for rid in done + expired:
                if self.leases.pop(rid, None) is not None:
                    self.w.loop.call(lambda e, rid=rid: e.release(rid))
