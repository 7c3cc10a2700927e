"""gRPC Prefill service.

A request's KV stays pinned after its first token until one of: the decode worker's NIXL
READ notification (the normal path), an Abort, or the lease running out. The lease lives on the
engine's request (`hold_for_s`); every way of freeing goes through the engine thread's command
queue, which runs a command even when the RPC that sent it has been cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.engine_loop import OutputQueue
from engine.llm_engine import RequestError
from services.rpc import grpc_api, pb
from services.worker.convert import FINISH_REASONS, sampling_from_proto
from services.worker.process import RoleService, Worker, now_ms
from services.worker.settings import PrefillSettings

log = logging.getLogger(__name__)
POLL_S = 0.01  # how often NIXL notifications and leases are checked


class PrefillService(RoleService, grpc_api.PrefillServicer):
    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        assert isinstance(worker.settings, PrefillSettings)
        self.lease_s = worker.settings.lease_seconds

    def register(self, server: grpc.aio.Server) -> None:
        grpc_api.add_PrefillServicer_to_server(self, server)

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        w, rid, start = self.w, request.request_id, time.monotonic()
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        outputs = OutputQueue()
        try:
            await w.loop.run(
                lambda e: e.add_request(
                    rid, prompt, params, hold_for_s=self.lease_s, listener=outputs
                )
            )
        except RequestError as e:
            w.metrics.fail("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            out = await outputs.get()
            held = None
            if out.finish_reason is None:
                held = await w.loop.run(lambda e: e.held_pages(rid))
        except asyncio.CancelledError:  # the router gave up: nobody will read this KV
            w.loop.call(lambda e: e.abort(rid))
            raise
        if out.finish_reason == "abort":
            w.metrics.fail("aborted")
            await context.abort(
                grpc.StatusCode.ABORTED, f"request {rid} was aborted during prefill"
            )
        w.metrics.tokens.labels(role="prefill", kind="prompt").inc(len(prompt))
        w.metrics.latency.labels(role="prefill").observe(time.monotonic() - start)
        w.metrics.requests.labels(role="prefill", outcome="ok").inc()
        response = pb.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            text=out.text,
            finish_reason=FINISH_REASONS[out.finish_reason],
            usage=pb.Usage(
                prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens
            ),
        )
        if held is not None:
            response.kv.CopyFrom(
                pb.KVHandle(
                    worker_id=w.worker_id,
                    agent_name=w.transfer.agent_name,
                    layout_hash=w.layout_hash,
                    layout=w.layout,
                    pages={g: pb.PageIds(ids=ids) for g, ids in held.pages.items()},
                    num_tokens=held.num_tokens,
                    lease_expires_unix_ms=now_ms() + int(self.lease_s * 1000),
                )
            )
        return response

    async def background(self) -> None:
        """Free held KV when its reader says it is done, or when its lease runs out."""
        w = self.w
        while True:
            await asyncio.sleep(POLL_S)
            notes = await w.in_nixl_thread(w.transfer.notifications)
            for _, msg in notes:
                rid = msg.decode(errors="replace")
                w.loop.call(lambda e, rid=rid: e.release(rid))
            expired = await w.loop.run(lambda e: e.expire_leases(time.monotonic()))
            for rid in expired:
                log.warning("KV lease of %s expired before a decode worker read it; freed", rid)
                w.metrics.fail("lease_expired")
