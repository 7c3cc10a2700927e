"""gRPC Prefill service.

A request's KV stays pinned after its first token until one of: the reader's Release (the
normal path), an Abort, or the lease running out. It is held in staging blocks when the pool has
room for it there (engine.kv.staging), else in its pages; the KV handle says which. A reader
Claims it before its NIXL READ (which extends the lease to cover the READ) and trusts what it
read only if Release answers `intact`. The leases live in a `LeaseTable` on the event loop, so
Claim, Release and Abort never wait behind an engine step; the engine frees what the table gave
up through its command queue, which runs a command even when the RPC that sent it has been
cancelled.

Before its first READ from this worker a reader loads its NIXL agent from Describe: over this
authenticated link, so pairing needs no registry.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from dsaserve.engine.engine_loop import OutputQueue
from dsaserve.engine.load import step_deadline
from dsaserve.engine.request import RequestError
from dsaserve.services.prefill.borrow import Borrower
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.worker.convert import (
    FINISH_REASONS,
    logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from dsaserve.services.worker.leases import LeaseTable
from dsaserve.services.worker.process import RoleService, Worker, now_ms
from dsaserve.services.worker.pull import KVPuller
from dsaserve.services.worker.settings import PrefillSettings

log = logging.getLogger(__name__)
LEASE_CHECK_S = 0.05  # how often held KV is checked for an expired lease
MAX_CLAIM_S = 600.0  # the longest hold a reader may ask for
# A lease lasts --lease-seconds, or this many of the worker's steps when that is longer: what a
# reader does inside it (the router's Decode call, the decode worker's reservation and Claim)
# queues behind steps too on a loaded host.
LEASE_STEPS = 100


class PrefillService(RoleService, grpc_api.PrefillServicer):
    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        assert isinstance(worker.settings, PrefillSettings)
        self.lease_s = worker.settings.lease_seconds
        self.leases = LeaseTable()
        self.aborted: set[str] = set()  # aborted while their Prefill call ran: never held
        self.borrower = Borrower(worker, KVPuller(worker, worker.settings.transfer_timeout))

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
        step_ms = w.loop.load().step_ms
        lease_s = step_deadline(self.lease_s, LEASE_STEPS, step_ms)
        outputs = OutputQueue()
        self.active.add(rid)
        try:
            grammar = await w.compile_grammar(params)
            source = request.kv_source if request.HasField("kv_source") else None
            # (a conversation's state after its last answer, from the decode worker that kept it)
            borrowed = source is not None and await self.borrower.borrow(
                rid, prompt, params, grammar, outputs, source
            )
            if not borrowed:
                await w.loop.run(
                    w.engine.add_request,
                    rid,
                    prompt,
                    params,
                    prefill_only=True,
                    listener=outputs,
                    grammar=grammar,
                )
            out = await outputs.get()
            held = None
            if out.finish_reason is None:  # packed for the reader's pull, if there is room
                held = await w.loop.run(w.engine.handoff.stage, rid)
                if rid in self.aborted:  # (the engine drops it at the abort's turn)
                    await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
                self.leases.hold(rid, time.monotonic() + lease_s)
        except RequestError as e:
            w.metrics.fail("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:  # the router gave up: nobody will read this KV
            self.leases.drop(rid, time.monotonic())
            w.abort(rid)
            raise
        finally:
            self.active.discard(rid)
            self.aborted.discard(rid)
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
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
            ),
            stop_reason=stop_reason_to_proto(out.stop_reason),
        )
        if out.logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(out.logprobs)[0])
        if out.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
        if held is not None:
            response.kv.CopyFrom(
                pb.KVHandle(
                    worker_id=w.worker_id,
                    agent_name=w.transfer.agent_name,
                    layout_hash=w.layout_hash,
                    layout=w.layout,
                    pages={g: pb.PageIds(ids=ids) for g, ids in held.pages.items()},
                    num_tokens=held.num_tokens,
                    lease_expires_unix_ms=now_ms() + int(lease_s * 1000),
                    address=w.address,
                    step_ms=step_ms,
                    draft_token_ids=held.draft_token_ids,
                    draft_confidences=held.draft_confidences,
                )
            )
        return response

    async def Claim(
        self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClaimResponse:
        rid, hold_s = request.request_id, min(request.hold_ms / 1000, MAX_CLAIM_S)
        now = time.monotonic()
        expired = rid in self.leases
        deadline = self.leases.claim(rid, hold_s, now)
        if deadline is None:
            if expired:  # (its lease ended before the sweep freed it)
                self.w.loop.call(self.w.engine.handoff.release, rid)
            self.w.metrics.fail("claim_too_late")
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request {rid} holds no KV here any more (its lease ran out, or it was aborted)",
            )
        assert deadline is not None  # (context.abort raised otherwise)
        return pb.ClaimResponse(lease_expires_unix_ms=now_ms() + int((deadline - now) * 1000))

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        rid = request.request_id
        intact = self.leases.drop(rid, time.monotonic())
        self.w.loop.call(self.w.engine.handoff.release, rid)
        return pb.ReleaseResponse(intact=intact)

    def let_go(self, request_id: str) -> bool:
        held = request_id in self.leases
        self.leases.drop(request_id, time.monotonic())
        if request_id in self.active:
            self.aborted.add(request_id)
        return held or request_id in self.active

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        # Both were computed when the agent was made: safe off the NIXL thread.
        transfer = self.w.transfer
        return pb.DescribeResponse(agent_name=transfer.agent_name, descriptor=transfer.descriptor())

    async def background(self) -> None:
        """Free held KV whose lease ran out before a reader released it."""
        w = self.w
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            for rid in self.leases.expire(time.monotonic()):
                w.loop.call(w.engine.handoff.release, rid)
                log.warning("KV lease of %s ran out before a decode worker released it", rid)
                w.metrics.fail("lease_expired")
