"""A prefill worker borrowing the state of a conversation's last turn from the decode worker
that decoded it (engine.loans): the router names that worker (`PrefillRequest.kv_source`) when
its cache holds more of the prompt than ours, which never computed the last answer. Lend, READ
of what our own cache lacks, Return (services.worker.pull); the request then computes only the
tokens after the lent state. Borrowing only ever saves work: anything that fails leaves the
prompt to be computed from what our cache resumes, with nothing of the loan left on either
side."""

from __future__ import annotations

import asyncio
import logging

import grpc

from dsaserve.engine.engine_loop import OutputQueue
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.structured import GrammarState
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.worker.process import Worker
from dsaserve.services.worker.pull import CONTROL_TIMEOUT_S, KVPuller, PullFailed

log = logging.getLogger(__name__)


class Borrower:
    def __init__(self, worker: Worker, puller: KVPuller) -> None:
        self.w, self.puller = worker, puller
        self._returns: set[asyncio.Task[bool]] = set()  # loans returned after a cancellation

    async def borrow(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        grammar: GrammarState | None,
        outputs: OutputQueue,
        source: pb.KVSource,
    ) -> bool:
        """Start `rid` from the state `source` lends (in the request's cache namespace): True
        once it computes the rest of its prompt; False when there was nothing worth borrowing or
        the pull failed."""
        w, puller = self.w, self.puller
        have = await w.loop.run(w.engine.loans.resume_position, prompt, params)
        decode = grpc_api.DecodeStub(puller.channel(source.address))
        lend = pb.LendRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            have_tokens=have,
            hold_ms=puller.hold_ms,
            cache_salt=params.cache_salt,
        )
        try:
            lent = await decode.Lend(lend, timeout=CONTROL_TIMEOUT_S, metadata=puller.metadata)
        except grpc.aio.AioRpcError as e:
            log.info("decode worker %s lent nothing for %s: %s", source.worker_id, rid, e.code())
            return False
        if not lent.HasField("kv"):
            return False
        kv, adopted = lent.kv, None
        try:
            peer = await puller.peer(kv, decode.Describe)
            adopted = await w.loop.run(
                w.engine.loans.adopt, rid, prompt, params, outputs, kv.num_tokens, grammar
            )
            if adopted is None:
                raise PullFailed("no_kv_space", "no free KV pages for the borrowed state")
        except PullFailed as e:  # (the loan is still out: return it)
            log.warning("borrowing %s from %s failed: %s", rid, kv.worker_id, e)
            await puller.release(decode.Return, kv, rid)
            return False
        except asyncio.CancelledError:
            self._return_later(decode, kv, rid)
            raise
        try:
            await puller.read(rid, peer, kv, adopted, decode.Return)
        except PullFailed as e:  # (returned by the pull; the pages are ours to free)
            log.warning("borrowing %s from %s failed: %s", rid, kv.worker_id, e)
            w.abort(rid)
            return False
        except asyncio.CancelledError:
            self._return_later(decode, kv, rid)
            raise
        return await w.loop.run(w.engine.loans.start, rid, kv.num_tokens)

    def _return_later(self, decode: grpc_api.DecodeStub, kv: pb.KVHandle, rid: str) -> None:
        """Return a loan from a cancelled borrow (its caller aborts our side)."""
        task = asyncio.get_running_loop().create_task(self.puller.release(decode.Return, kv, rid))
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)
