"""gRPC Decode service: reserve pages, pull the prefilled KV over NIXL, decode, stream.

Pages are reserved first (waiting while the pools are full, no longer than the prefill lease).
The pull is Claim (the prefill worker keeps the KV for the READ), READ, Release. Where the
handle names staging blocks, the READ is a pull of those blocks, scattered into our pages as
they land (KVTransfer.pull); else one READ of the prefill worker's pages. A READ is one-sided
and the prefill worker reuses freed memory at once, so the pulled KV is used only when Release
says it was held until the READ had finished; otherwise the request ends with a clear error
(cause "lease_expired"), never with tokens computed from someone else's KV.

A request whose prompt starts with a conversation this worker decoded before shares the full
entry pages of that prefix from its prefix cache (`Handoff.reserve`) and pulls only the rest:
the staged stream puts the newest pages first, so that is the stream's first blocks
(KVPool.stream), or the pages past the shared ones. `dsaserve_kv_pulled_pages_total` and
`dsaserve_kv_reused_pages_total` count both. Only full entry pages are reused (a pulled request
brings its state at the prompt's end: ring pages, slab row and open pages), and why the reader
decides this and not the prefill side: the hit length would have to reach the prefill worker
before it stages (and a reader that lost its prefix meanwhile could not recover), and a page
READ of sliced lists pays for many small descriptors. So the prefill side is unchanged, the
reader decides what it lacks when it reserves, from pages it then holds, and a reader that lost
them pulls more of the same stream.

Before the first pull from a prefill agent, the prefill worker's Describe (gRPC, at the handle's
address) gives its NIXL descriptor. The registry is not asked: while Redis is down a decode
worker still pairs with a prefill worker it has not met (e.g. one restarted as a new agent).

The router sends its requests over DecodeStream, which runs each as a Decode call would run
(services/decode/multiplex.py). Every way out of a Decode call - done, error, the router
cancelling the stream or the request - leaves no pages behind: the request is aborted in the
engine unless it finished there. A call cancelled during its READ frees its pages only once the
READ has ended: it writes into them until then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from dsaserve.engine.engine_loop import OutputQueue
from dsaserve.engine.request import KVPages, RequestError
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.services.decode.multiplex import CallContext, multiplex
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.worker.convert import (
    FINISH_REASONS,
    logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from dsaserve.services.worker.leases import LeaseTable
from dsaserve.services.worker.process import RoleService, Worker, now_ms
from dsaserve.services.worker.pull import KVPuller, PullFailed
from dsaserve.services.worker.settings import DecodeSettings

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.01  # how often a request waiting for free pages retries
LOAN_CHECK_S = 0.05  # how often loans are checked for an expired lease
MAX_HOLD_S = 600.0  # the longest hold a borrower may ask for
LOAN = "{}.loan"  # a loan's id in the engine (the borrower's request decodes here next)


class DecodeService(RoleService, grpc_api.DecodeServicer):
    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        settings = worker.settings
        assert isinstance(settings, DecodeSettings)
        self.stream_interval = settings.stream_interval
        self.puller = KVPuller(worker, settings.transfer_timeout)
        self.loans = LeaseTable()  # what prefill workers borrow from our prefix cache

    def register(self, server: grpc.aio.Server) -> None:
        grpc_api.add_DecodeServicer_to_server(self, server)

    async def Decode(
        self, request: pb.DecodeRequest, context: CallContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        w, rid, kv, start = self.w, request.request_id, request.kv, time.monotonic()
        if not rid or not request.HasField("kv") or not kv.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id and kv (with its address) are required",
            )
        if kv.layout_hash != w.layout_hash:
            w.metrics.fail("layout_mismatch")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: prefill worker {kv.worker_id} has layout "
                f"{kv.layout or kv.layout_hash}, decode worker {w.worker_id} has layout "
                f"{w.layout}; run both with the same model, --dtype, --kv-cache-dtype and "
                "--block-size",
            )
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = False
        self.active.add(rid)
        try:
            outputs = OutputQueue()
            reserved = await self._reserve(request, params, outputs, context)
            try:
                await self._pull(rid, kv, reserved)
            except PullFailed as e:
                w.metrics.fail(e.cause)
                if e.cause == "layout_mismatch":
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
                log.warning("KV pull for %s from %s failed: %s", rid, kv.worker_id, e)
                yield pb.DecodeResponse(error=pb.DecodeError(message=str(e), cause=e.cause))
                return
            await w.loop.run(w.engine.handoff.join, rid)
            async for out in w.loop.stream(rid, outputs, self.stream_interval):
                if out.finish_reason == "abort":
                    w.metrics.fail("aborted")
                    yield pb.DecodeResponse(
                        error=pb.DecodeError(message=f"request {rid} was aborted", cause="abort")
                    )
                    return
                chunk = pb.DecodeChunk(
                    token_ids=out.new_token_ids,
                    text=out.text,
                    logprobs=logprobs_to_proto(out.logprobs or []),
                )
                yield pb.DecodeResponse(chunk=chunk)
                w.metrics.tokens.labels(role="decode", kind="generated").inc(len(out.new_token_ids))
                if out.finished:
                    finished = True
                    w.metrics.requests.labels(role="decode", outcome="ok").inc()
                    w.metrics.latency.labels(role="decode").observe(time.monotonic() - start)
                    usage = pb.Usage(
                        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens
                    )
                    yield pb.DecodeResponse(
                        done=pb.DecodeDone(
                            finish_reason=FINISH_REASONS[out.finish_reason],
                            usage=usage,
                            stop_reason=stop_reason_to_proto(out.stop_reason),
                        )
                    )
        finally:
            self.active.discard(rid)
            if not finished:  # error, abort or a cancelled stream: free whatever we reserved
                w.abort(rid)

    async def DecodeStream(
        self,
        requests: AsyncIterator[pb.DecodeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.DecodeStreamResponse]:
        async for message in multiplex(self.Decode, requests, context, self.w.stopping):
            yield message

    async def _reserve(
        self,
        request: pb.DecodeRequest,
        params: SamplingParams,
        outputs: OutputQueue,
        context: CallContext,
    ) -> KVPages:
        """Pages for the request's KV; waits while the pools are full, up to the prefill lease."""
        w, rid = self.w, request.request_id
        prompt, first = list(request.prompt_token_ids), request.first_token_id
        drafts = list(request.kv.draft_token_ids)  # verified at its first step
        confidences = list(request.kv.draft_confidences)
        deadline = time.monotonic() + max(0.0, (request.kv.lease_expires_unix_ms - now_ms()) / 1000)
        try:
            grammar = await w.compile_grammar(params)
        except RequestError as e:
            w.metrics.fail("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        while True:
            try:
                reserved = await w.loop.run(
                    w.engine.handoff.reserve,
                    rid,
                    prompt,
                    first,
                    params,
                    outputs,
                    drafts,
                    confidences,
                    grammar,
                )
            except RequestError as e:
                w.metrics.fail("invalid_request")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if reserved is not None:
                return reserved
            if time.monotonic() > deadline:
                w.metrics.fail("no_kv_space")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode worker {w.worker_id} had no free KV pages before the prefill lease "
                    "ran out",
                )
            await asyncio.sleep(RESERVE_RETRY_S)

    async def _pull(self, rid: str, kv: pb.KVHandle, reserved: KVPages) -> None:
        """Claim, READ, Release (services.worker.pull); PullFailed unless the pages read were
        intact."""
        prefill = grpc_api.PrefillStub(self.puller.channel(kv.address))
        peer = await self.puller.peer(kv, prefill.Describe)
        try:
            await prefill.Claim(
                pb.ClaimRequest(request_id=rid, hold_ms=self.puller.hold_ms),
                timeout=self.puller.control_s(kv),
                metadata=self.puller.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise PullFailed(
                    "lease_expired",
                    f"prefill worker {kv.worker_id} freed the KV of {rid} before it could be read "
                    "(its lease ran out); the request must be retried",
                ) from None
            raise PullFailed(
                "peer_unreachable",
                f"prefill worker {kv.worker_id} refused the claim: {e.details()}",
            ) from None
        await self.puller.read(rid, peer, kv, reserved, prefill.Release)

    # ---------------------------------------------------------------- lending

    async def Lend(
        self, request: pb.LendRequest, context: grpc.aio.ServicerContext
    ) -> pb.LendResponse:
        """Hold for a prefill worker the state of the longest prefix of its prompt our cache
        resumes past what its own does (engine.loans); an empty answer when there is none."""
        w, loan = self.w, LOAN.format(request.request_id)
        try:
            salt = request.cache_salt if request.HasField("cache_salt") else None
            lent = await w.loop.run(
                w.engine.loans.lend, loan, list(request.prompt_token_ids), request.have_tokens, salt
            )
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if lent is None:
            return pb.LendResponse()
        hold_s = min(request.hold_ms / 1000, MAX_HOLD_S)
        self.loans.hold(loan, time.monotonic() + hold_s)
        return pb.LendResponse(
            kv=pb.KVHandle(
                worker_id=w.worker_id,
                agent_name=w.transfer.agent_name,
                layout_hash=w.layout_hash,
                layout=w.layout,
                pages={g: pb.PageIds(ids=ids) for g, ids in lent.pages.items()},
                num_tokens=lent.num_tokens,
                lease_expires_unix_ms=now_ms() + int(hold_s * 1000),
                address=w.address,
                step_ms=w.loop.load().step_ms,
            )
        )

    async def Return(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        loan = LOAN.format(request.request_id)
        intact = self.loans.drop(loan, time.monotonic())
        self.w.loop.call(self.w.engine.handoff.release, loan)
        return pb.ReleaseResponse(intact=intact)

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        # Both were computed when the agent was made: safe off the NIXL thread.
        transfer = self.w.transfer
        return pb.DescribeResponse(agent_name=transfer.agent_name, descriptor=transfer.descriptor())

    async def background(self) -> None:
        """Free loans whose lease ran out before their borrower returned them."""
        while True:
            await asyncio.sleep(LOAN_CHECK_S)
            for loan in self.loans.expire(time.monotonic()):
                self.w.loop.call(self.w.engine.handoff.release, loan)
                log.warning("the loan %s ran out before its borrower returned it", loan)
