"""One request through the disaggregated path: Prefill on one worker, Decode on another.

`PDFlow.generate` is an async generator of `Token` and `Finish` events, so streaming and
non-streaming answers share one flow. Its cleanup runs however it ends (finish, error, the
consumer closing it, cancellation) and never awaits, because it may run under cancellation:
an unfinished Decode is cancelled (the decode worker frees on cancellation; the router's
requests share a DecodeStream per worker, decode_stream.py), and a prefill worker that may
still hold the request's KV gets an `Abort`.

A Decode that sends nothing for the stall timeout fails (the longer of --stall-timeout and
STALL_STEPS of the decode worker's steps, engine.load.step_deadline), bounded with one timer per
stall period rather than one per token (`_ReadWatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

import grpc

from dsaserve.engine.load import step_deadline
from dsaserve.services.registry import WorkerRecord
from dsaserve.services.router.api.errors import APIError, from_grpc, timeout_error, worker_failure
from dsaserve.services.router.clients import WorkerClients
from dsaserve.services.router.decode_room import DecodeRoom, Transit
from dsaserve.services.router.decode_stream import DecodeHandle
from dsaserve.services.router.metrics import RequestTimer
from dsaserve.services.router.selection import WorkerSelector
from dsaserve.services.rpc import pb

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Token:
    """Output tokens and their text (which may be empty: text held back for a stop string, a
    partial character, a special token); logprobs, one per token id, when the request asked."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[pb.TokenLogprob, ...] = ()
    # The first event only, when the request asked: the prompt's tokens after the first
    prompt_logprobs: tuple[pb.TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefill worker resumed from its prefix cache
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id (None: EOS)


Event = Token | Finish

# Prefill statuses that mean the worker refused the request and holds nothing for it.
_REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
}
UNHEALTHY_FOR_S = 30.0  # a worker that failed or stalled is skipped this long by new requests
# A decode stream sends a message a step; it has stalled after --stall-timeout without one, or
# after this many of its worker's measured steps when that is longer (a slow or loaded worker).
STALL_STEPS = 20
# Decode errors (DecodeError.cause) after which the same request may well succeed, as clients
# are told them (the decode worker's own message names workers: it goes to the log).
_RETRYABLE = {
    "lease_expired": "The prefill worker freed the prompt's KV state before the decode worker "
    "read it (its lease ran out); the request must be retried.",
    "transfer": "Moving the prompt's KV state to the decode worker failed; the request must be "
    "retried.",
    "peer_unreachable": "The decode worker could not reach the prefill worker for the "
    "prompt's KV state; the request must be retried.",
    "peer_unknown": "The prefill worker restarted before the decode worker read the prompt's KV "
    "state; the request must be retried.",
}
_FINISH_REASONS: dict[int, str] = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Generation:
    request_id: str
    prompt_ids: list[int]
    sampling: pb.SamplingParams
    deadline: float  # time.monotonic() by which the request must be done
    timeout_s: float  # the configured total, for messages
    timer: RequestTimer
    # max_tokens 0 (echo): prefill samples one token (the wire's least), which is dropped
    prompt_only: bool = False

    @property
    def cache_salt(self) -> str | None:
        """The prefix-cache namespace its prompt may resume from."""
        return self.sampling.cache_salt if self.sampling.HasField("cache_salt") else None

    def remaining(self, where: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise timeout_error(self.timeout_s, where)
        return left


class PDFlow:
    def __init__(
        self,
        selector: WorkerSelector,
        clients: WorkerClients,
        stall_timeout_s: float,
        room: DecodeRoom,
    ) -> None:
        self._selector = selector
        self._clients = clients
        self._stall_timeout_s = stall_timeout_s
        self._room = room

    async def generate(self, gen: Generation) -> AsyncGenerator[Event, None]:
        # No prompt is computed before some decode worker has room for its KV.
        transit = await self._room.enter(gen.remaining("waiting for a decode worker's room"))
        try:
            # (closed here, not when collected: its cleanup cancels calls and aborts)
            async with contextlib.aclosing(self._generate(gen, transit)) as events:
                async for event in events:
                    yield event
        finally:
            transit.leave()

    async def _generate(self, gen: Generation, transit: Transit) -> AsyncGenerator[Event, None]:
        prefill_worker, first = await self._retry_once(
            "prefill",
            lambda exclude: self._selector.prefill(exclude, gen.prompt_ids, gen.cache_salt),
            lambda w: self._prefill(w, gen),
        )
        gen.timer.token()
        finished = False  # once True, nobody holds KV for this request any more
        try:
            prompt_logprobs = tuple(first.prompt_logprobs)
            if gen.prompt_only and first.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finish = self._finish(first, prefill_worker, gen, first)
                finished = True
                yield Token("", (), (), prompt_logprobs)
                yield Finish("length", finish.prompt_tokens, 0, finish.cached_tokens)
                return
            first_logprobs = (first.first_logprob,) if first.HasField("first_logprob") else ()
            yield Token(first.text, (first.first_token_id,), first_logprobs, prompt_logprobs)
            if first.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finish = self._finish(first, prefill_worker, gen, first)
                finished = True
                yield finish
                return
            decode_worker, (call, response) = await self._retry_once(
                "decode",
                lambda exclude: self._selector.decode(
                    prefill_worker.layout_hash, exclude, gen.prompt_ids, gen.cache_salt
                ),
                lambda w: self._open_decode(w, gen, first),
            )
            answer = [first.first_token_id]  # (what the decode worker keeps with the prompt)
            transit.leave()  # (its pages are reserved there: its records count them soon)
            # the stall bound: the worker's own steps, as it last reported them, or the flag
            stall_s = step_deadline(self._stall_timeout_s, STALL_STEPS, decode_worker.load.step_ms)
            watch = _ReadWatch(stall_s, gen.deadline)
            try:
                with self._clients.busy(decode_worker.worker_id):
                    while response is not grpc.aio.EOF:
                        event = self._event(response, decode_worker, gen, first)
                        if isinstance(event, Finish):
                            finished = True
                            await self._drain(call)  # end the call cleanly, not by cancelling
                            self._selector.decoded(
                                decode_worker, gen.prompt_ids + answer, gen.cache_salt
                            )
                            yield event
                            return
                        answer += event.token_ids
                        yield event
                        response = await self._read(call, watch, decode_worker, gen)
                raise worker_failure(
                    500,
                    "The decode worker ended the stream without a finish reason.",
                    cause="protocol",
                    role="decode",
                    address=decode_worker.address,
                    detail="stream ended without a finish reason",
                )
            finally:
                watch.close()
                call.cancel()  # no-op once the call is complete
        finally:
            if not finished:
                self._clients.abort_later(prefill_worker, gen.request_id)

    def _event(
        self,
        response: pb.DecodeResponse,
        worker: WorkerRecord,
        gen: Generation,
        first: pb.PrefillResponse,
    ) -> Event:
        """What one Decode message means for the client (`first`: what Prefill answered)."""
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            gen.timer.token()
            chunk = response.chunk
            return Token(chunk.text, tuple(chunk.token_ids), tuple(chunk.logprobs))
        if kind == "done":
            return self._finish(response.done, worker, gen, first)
        if kind == "error":
            cause = response.error.cause or "decode_error"
            # The KV could not be pulled intact: nothing is wrong with the request itself.
            retry = cause in _RETRYABLE
            raise worker_failure(
                503 if retry else 500,
                _RETRYABLE.get(cause, f"The decode worker failed the request ({cause})."),
                cause=cause,
                role="decode",
                address=worker.address,
                detail=response.error.message,
            )
        raise worker_failure(
            500,
            "The decode worker sent an empty message.",
            cause="protocol",
            role="decode",
            address=worker.address,
            detail="empty message",
        )

    async def _retry_once(
        self,
        role: str,
        pick: Callable[[Collection[str]], WorkerRecord],
        call: Callable[[WorkerRecord], Awaitable[T]],
    ) -> tuple[WorkerRecord, T]:
        """Run `call` on a picked worker; if it is UNAVAILABLE, once more on another one.

        Safe only because a failed call produced nothing the client has seen.
        """
        tried: set[str] = set()
        last: APIError | None = None
        for _ in range(2):
            try:
                worker = pick(tried)
            except APIError:
                if last is not None:
                    raise last from None  # the worker's own failure says more than "none left"
                raise
            tried.add(worker.worker_id)
            try:
                return worker, await call(worker)
            except grpc.aio.AioRpcError as e:
                last = from_grpc(e, role, worker.address)
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise last from None
                self._selector.mark_unhealthy(worker.worker_id, UNHEALTHY_FOR_S, "unavailable")
                log.warning(
                    "%s worker %s unavailable (%s); retrying on another",
                    role,
                    worker.address,
                    e.details(),
                )
        assert last is not None
        raise last

    async def _prefill(self, worker: WorkerRecord, gen: Generation) -> pb.PrefillResponse:
        request = pb.PrefillRequest(
            request_id=gen.request_id, prompt_token_ids=gen.prompt_ids, sampling=gen.sampling
        )
        # (a conversation's last answer: its decode worker kept it, the prefill worker did not)
        lender = self._selector.lender(worker, gen.prompt_ids, gen.cache_salt)
        if lender is not None:
            request.kv_source.CopyFrom(
                pb.KVSource(worker_id=lender.worker_id, address=lender.address)
            )
        timeout = gen.remaining("before prefill")
        with self._clients.busy(worker.worker_id):
            try:
                return await self._clients.prefill(worker).Prefill(
                    request, timeout=timeout, metadata=self._clients.metadata
                )
            except grpc.aio.AioRpcError as e:
                if e.code() not in _REFUSED:  # e.g. a deadline: the KV may be pinned by now
                    self._clients.abort_later(worker, gen.request_id)
                raise
            except asyncio.CancelledError:  # the client left while the worker was prefilling
                self._clients.abort_later(worker, gen.request_id)
                raise

    async def _open_decode(
        self, worker: WorkerRecord, gen: Generation, first: pb.PrefillResponse
    ) -> tuple[DecodeHandle, pb.DecodeResponse]:
        """Start the request on the worker's DecodeStream and read its first message, so a
        dead worker fails here."""
        request = pb.DecodeRequest(
            request_id=gen.request_id,
            prompt_token_ids=gen.prompt_ids,
            first_token_id=first.first_token_id,
            sampling=gen.sampling,
            kv=first.kv,
        )
        call = self._clients.decode_stream(worker).start(request, gen.remaining("before decode"))
        try:
            return call, await call.read()
        except BaseException:
            call.cancel()
            raise

    @staticmethod
    async def _drain(call: DecodeHandle) -> None:
        """Read to the end after `done`; bounded by the call's deadline."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:
                pass

    async def _read(
        self, call: DecodeHandle, watch: _ReadWatch, worker: WorkerRecord, gen: Generation
    ) -> pb.DecodeResponse:
        """The stream's next message. A worker that sends nothing for the stall timeout is
        abandoned (and skipped by new requests for a while): gRPC keepalive catches a dead or
        frozen process, this catches a live one whose engine stopped producing."""
        gen.remaining("while decoding")  # raises once the deadline has passed
        task = watch.reading()
        try:
            return await call.read()
        except asyncio.CancelledError:
            if not watch.expired or task.uncancel() > 0:  # (someone else's cancellation too)
                raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._selector.mark_unhealthy(worker.worker_id, UNHEALTHY_FOR_S, "unavailable")
            raise from_grpc(e, "decode", worker.address) from None
        finally:
            watch.done_reading()
        call.cancel()
        if watch.deadline_first:
            raise timeout_error(gen.timeout_s, "while decoding")
        stall = watch.stall_s
        self._selector.mark_unhealthy(worker.worker_id, UNHEALTHY_FOR_S, "stalled")
        raise worker_failure(
            503,
            f"The decode worker sent nothing for {stall:g} s and was abandoned; retry the request.",
            cause="stalled",
            role="decode",
            address=worker.address,
            detail=f"stalled {stall:g} s",
        )

    @staticmethod
    def _finish(
        end: pb.PrefillResponse | pb.DecodeDone,
        worker: WorkerRecord,
        gen: Generation,
        first: pb.PrefillResponse,
    ) -> Finish:
        """The generation's end (`end`: the message that says it, with its finish and stop
        reasons); the cached tokens are the prefill worker's (`first`), which computed the
        prompt."""
        reason, usage = end.finish_reason, end.usage
        if reason == pb.FINISH_REASON_ABORT:
            raise worker_failure(
                503,
                f"The {worker.role} worker aborted the request; retry it.",
                cause="worker_abort",
                role=worker.role,
                address=worker.address,
                detail="finish reason abort",
            )
        if reason not in _FINISH_REASONS:
            raise worker_failure(
                500,
                f"The {worker.role} worker sent unknown finish reason {reason}.",
                cause="protocol",
                role=worker.role,
                address=worker.address,
                detail=f"finish reason {reason}",
            )
        gen.timer.finish(usage.prompt_tokens, usage.completion_tokens)
        stop = end.stop_reason.WhichOneof("kind") if end.HasField("stop_reason") else None
        return Finish(
            _FINISH_REASONS[reason],
            usage.prompt_tokens,
            usage.completion_tokens,
            first.usage.cached_tokens,
            None if stop is None else getattr(end.stop_reason, stop),
        )


class _ReadWatch:
    """Bounds each read of a Decode stream by the stall timeout and the request's deadline, as
    asyncio.timeout around each read would, with one timer per stall period instead of one per
    message (a read happens once per token): when the timer fires it re-arms itself for the
    read in progress, unless that read has waited too long, and then it cancels the reading
    task (`expired`). Times are the loop's (time.monotonic, as the deadline)."""

    def __init__(self, stall_s: float, deadline: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._stall_s, self._deadline = stall_s, deadline
        self._task: asyncio.Task[object] | None = None  # the task in a read, None between them
        self._since = 0.0  # when the read in progress began
        self._timer: asyncio.TimerHandle | None = None
        self.expired = False

    @property
    def stall_s(self) -> float:
        return self._stall_s

    @property
    def deadline_first(self) -> bool:
        """Whether the request's deadline, not the stall timeout, ended the read."""
        return self._deadline <= self._since + self._stall_s

    def reading(self) -> asyncio.Task[object]:
        """A read begins in the current task."""
        task = asyncio.current_task()
        assert task is not None
        self._task, self._since = task, self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._due(), self._check)
        return task

    def done_reading(self) -> None:
        self._task = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> float:
        return min(self._since + self._stall_s, self._deadline)

    def _check(self) -> None:
        self._timer = None
        if self._task is None:  # between reads: the next read arms the timer again
            return
        if self._loop.time() >= self._due():
            self.expired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(self._due(), self._check)
