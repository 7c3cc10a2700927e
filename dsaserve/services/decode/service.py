"""gRPC Decode service: reserve pages, pull the prefilled KV over NIXL, decode, stream.

The pull is Claim (the prefill worker keeps the KV for the READ), READ, Release. Where the
handle names staging blocks, the READ is a pull of those blocks, scattered into our pages as
they land (KVTransfer.pull); else one READ of the prefill worker's pages. A READ is one-sided
and the prefill worker reuses freed memory at once, so the pulled KV is used only when Release
says it was held until the READ had finished; otherwise the request ends with a clear error
(cause "lease_expired"), never with tokens computed from someone else's KV.

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
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator

import grpc

from dsaserve.engine.engine_loop import OutputQueue
from dsaserve.engine.kv.layout import STAGING
from dsaserve.engine.load import step_deadline
from dsaserve.engine.request import KVPages, RequestError
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.services import connections
from dsaserve.services.auth import token_metadata
from dsaserve.services.decode.multiplex import CallContext, multiplex
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.transfer import TransferError, TransferStats
from dsaserve.services.worker.convert import (
    FINISH_REASONS,
    logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from dsaserve.services.worker.process import RoleService, Worker, now_ms
from dsaserve.services.worker.settings import DecodeSettings

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.01  # how often a request waiting for free pages retries
CLAIM_MARGIN_S = 5.0  # a claim outlasts the READ's own timeout by this much
# Bound on one Claim, Release or Describe call: at least this, longer for a prefill worker
# whose steps are slow (a loaded host answers every RPC slowly, the control ones too).
CONTROL_TIMEOUT_S = 10.0
CONTROL_STEPS = 10


class PullFailed(Exception):
    """The prefilled KV could not be pulled; `cause` labels it for metrics and the router."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class DecodeService(RoleService, grpc_api.DecodeServicer):
    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        settings = worker.settings
        assert isinstance(settings, DecodeSettings)
        self.transfer_timeout = settings.transfer_timeout
        self.stream_interval = settings.stream_interval
        self.metadata = token_metadata(settings.cluster_token)
        self.tls = settings.tls
        self.peers: dict[str, str] = {}  # prefill worker id -> its NIXL agent we have loaded
        self.prefill_stubs: dict[str, grpc_api.PrefillStub] = {}  # by address
        self.reads: dict[str, concurrent.futures.Future[TransferStats]] = {}  # READs in flight

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
                await self._pull(rid, kv, reserved, context)
            except PullFailed as e:
                w.metrics.fail(e.cause)
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
                read = self.reads.pop(rid, None)
                if read is None:
                    w.loop.call(w.engine.abort, rid)
                else:  # (runs at once if the READ is over)
                    read.add_done_callback(lambda _: w.loop.call(w.engine.abort, rid))

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

    async def _pull(
        self, rid: str, kv: pb.KVHandle, reserved: KVPages, context: CallContext
    ) -> None:
        """Claim, READ, Release; raises PullFailed unless the pages read were intact."""
        w = self.w
        prefill = self._prefill(kv.address)
        control_s = step_deadline(CONTROL_TIMEOUT_S, CONTROL_STEPS, kv.step_ms)
        peer = await self._peer(kv, prefill, context, control_s)
        hold_ms = int((self.transfer_timeout + CLAIM_MARGIN_S) * 1000)
        try:
            await prefill.Claim(
                pb.ClaimRequest(request_id=rid, hold_ms=hold_ms),
                timeout=control_s,
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise PullFailed(
                    "lease_expired",
                    f"prefill worker {kv.worker_id} freed the KV of {rid} before it could be read "
                    "(its lease ran out); the request must be retried",
                ) from None
            raise PullFailed(
                "prefill_unreachable",
                f"prefill worker {kv.worker_id} refused the claim: {e.details()}",
            ) from None
        remote = {g: list(p.ids) for g, p in kv.pages.items()}
        if STAGING in remote:
            read = w.nixl_submit(self._pull_staged, peer, remote[STAGING], reserved)
        else:
            read = w.nixl_submit(
                w.transfer.read, peer, remote, reserved.pages, timeout_s=self.transfer_timeout
            )
        self.reads[rid] = read
        try:
            stats = await asyncio.wrap_future(read)
            del self.reads[rid]
        except TransferError as e:
            self.peers.pop(kv.worker_id, None)  # Describe it afresh next time
            # free them there now, not at the lease's end
            await self._release(prefill, rid, control_s)
            raise PullFailed("transfer", f"KV transfer from {kv.worker_id} failed: {e}") from e
        if not await self._release(prefill, rid, control_s):
            raise PullFailed(
                "lease_expired",
                f"prefill worker {kv.worker_id} freed the KV of {rid} before the transfer "
                "finished (its lease ran out); the request must be retried",
            )
        w.metrics.transfer_bytes.inc(stats.bytes)
        w.metrics.transfer_seconds.observe(stats.seconds)

    def _pull_staged(self, peer: str, blocks: list[int], reserved: KVPages) -> TransferStats:
        """Pull staged KV into our reserved pages (on the NIXL thread). The pool's geometry is
        fixed and only these pages are written, which no step reads before the request joins,
        so this thread may use the engine's pool."""
        pool = self.w.engine.pool
        unpack = pool.unpacker(reserved.pages)
        return self.w.transfer.pull(
            peer,
            STAGING,
            blocks,
            pool.staging.ring,
            unpack.nbytes,
            unpack,
            timeout_s=self.transfer_timeout,
        )

    async def _release(self, prefill: grpc_api.PrefillStub, rid: str, timeout_s: float) -> bool:
        """Release the pages at the prefill worker; True if they were intact until now."""
        try:
            response = await prefill.Release(
                pb.ReleaseRequest(request_id=rid), timeout=timeout_s, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as e:  # unknown: the read cannot be trusted
            log.warning("Release(%s) failed: %s", rid, e.code())
            return False
        return response.intact

    def _prefill(self, address: str) -> grpc_api.PrefillStub:
        if address not in self.prefill_stubs:
            channel = connections.open_channel(address, self.tls)
            self.prefill_stubs[address] = grpc_api.PrefillStub(channel)
        return self.prefill_stubs[address]

    async def _peer(
        self,
        kv: pb.KVHandle,
        prefill: grpc_api.PrefillStub,
        context: CallContext,
        timeout_s: float,
    ) -> str:
        """The prefill worker's NIXL agent, loaded once per agent from the worker's Describe.

        A restarted worker keeps its id but gets a new agent name: the old agent is dropped. A
        handle naming another agent than the worker runs now was made before it restarted, and
        the KV it names died with that process.
        """
        agent = kv.agent_name
        if self.peers.get(kv.worker_id) == agent:
            return agent
        try:
            described = await prefill.Describe(
                pb.DescribeRequest(), timeout=timeout_s, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as e:
            raise PullFailed(
                "prefill_unreachable",
                f"prefill worker {kv.worker_id} did not describe its NIXL agent: {e.details()}",
            ) from None
        if described.agent_name != agent:
            raise PullFailed(
                "peer_unknown",
                f"prefill worker {kv.worker_id} restarted: it runs NIXL agent "
                f"{described.agent_name}, not {agent} which held the KV; the request must be "
                "retried",
            )
        known = self.peers.get(kv.worker_id)  # again: another request may have loaded it since
        if known == agent:
            return agent
        if known is not None:
            await self.w.in_nixl_thread(self.w.transfer.remove_peer, known)
        try:
            await self.w.in_nixl_thread(self.w.transfer.add_peer, described.descriptor)
        except TransferError as e:
            self.w.metrics.fail("layout_mismatch")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.peers[kv.worker_id] = agent
        return agent
