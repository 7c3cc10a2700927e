"""Scripted gRPC workers for router tests: the real wire contract, outputs from a script.

`ScriptedWorker` plays both worker roles (Prefill: the first token's text, then Decode: chunks,
then done) and records what it was sent. The `serve` and `make_router` fixtures (conftest.py)
run them on free ports, registered in Redis as real workers register.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from dsaserve.engine.load import Load
from dsaserve.services.auth import TOKEN_METADATA_KEY
from dsaserve.services.decode.multiplex import CallContext, multiplex
from dsaserve.services.registry import WorkerRecord, WorkerRegistration
from dsaserve.services.rpc import grpc_api, pb

MODEL = "tiny-router-model"
TOKEN = "secret-token"
WAIT_S = 10.0  # bound on every wait for a worker-side event


def scripted_logprob(token_id: int, k: int) -> pb.TokenLogprob:
    """The logprobs a ScriptedWorker reports for a token: made up, but a function of the token."""
    top = [(token_id + j) % 256 for j in range(k)]
    return pb.TokenLogprob(
        logprob=-(token_id % 7) / 8, top_token_ids=top, top_logprobs=[-j / 4 for j in range(k)]
    )


def chunk_ids(text: str) -> list[int]:
    """A scripted chunk's token ids: its UTF-8 bytes (the tiny tokenizers' ids for them)."""
    return list(text.encode())


@dataclass
class ScriptedWorker(grpc_api.PrefillServicer, grpc_api.DecodeServicer):
    """Both worker roles from a script: first text from Prefill, then chunks, then done.

    Chunk token ids are the text's bytes; with `sampling.logprobs` set, every token carries
    `scripted_logprob`. Scripts may be changed between requests.
    """

    first_text: str = "He"
    first_token_id: int = 72
    chunks: tuple[str, ...] = ("llo", " world")
    decode_finish: int = pb.FINISH_REASON_STOP
    prefill_finish: int = pb.FINISH_REASON_UNSPECIFIED
    prefill_status: grpc.StatusCode | None = None
    decode_error: str | None = None
    hold_decode: asyncio.Event | None = None  # Decode waits on it after its chunks
    cached_tokens: int = 0  # what Prefill reports resumed from a prefix cache
    prefill_requests: list[pb.PrefillRequest] = field(default_factory=list)
    decode_requests: list[pb.DecodeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    abort_seen: asyncio.Event = field(default_factory=asyncio.Event)
    decode_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def _check_token(self, context: CallContext) -> None:
        if dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY) != TOKEN:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad cluster token")

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        await self._check_token(context)
        self.prefill_requests.append(request)
        if self.prefill_status is not None:
            await context.abort(self.prefill_status, f"scripted {self.prefill_status.name}")
        usage = pb.Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=1,
            cached_tokens=min(self.cached_tokens, len(request.prompt_token_ids) - 1),
        )
        response = pb.PrefillResponse(
            first_token_id=self.first_token_id, text=self.first_text, usage=usage
        )
        if request.sampling.HasField("logprobs"):
            response.first_logprob.CopyFrom(
                scripted_logprob(self.first_token_id, request.sampling.logprobs)
            )
        if self.prefill_finish:
            response.finish_reason = self.prefill_finish
            return response
        response.kv.CopyFrom(
            pb.KVHandle(
                worker_id="scripted",
                agent_name="agent",
                layout_hash="L1",
                num_tokens=len(request.prompt_token_ids),
            )
        )
        return response

    async def Decode(
        self, request: pb.DecodeRequest, context: CallContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        await self._check_token(context)
        self.decode_requests.append(request)
        try:
            for text in self.chunks:
                chunk = pb.DecodeChunk(token_ids=chunk_ids(text), text=text)
                if request.sampling.HasField("logprobs"):
                    k = request.sampling.logprobs
                    chunk.logprobs.extend(scripted_logprob(t, k) for t in chunk.token_ids)
                yield pb.DecodeResponse(chunk=chunk)
            if self.hold_decode is not None:
                await self.hold_decode.wait()
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise
        if self.decode_error is not None:
            yield pb.DecodeResponse(
                error=pb.DecodeError(message=self.decode_error, cause="transfer")
            )
            return
        usage = pb.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=1 + len(self.chunks)
        )
        yield pb.DecodeResponse(done=pb.DecodeDone(finish_reason=self.decode_finish, usage=usage))

    async def DecodeStream(
        self,
        requests: AsyncIterator[pb.DecodeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.DecodeStreamResponse]:
        # the real worker's multiplexing over this script's Decode, as the router's calls go
        async for message in multiplex(self.Decode, requests, context):
            yield message

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        await self._check_token(context)
        self.aborted.append(request.request_id)
        self.abort_seen.set()
        return pb.AbortResponse(found=True)


Serve = Callable[..., Awaitable[ScriptedWorker]]


@contextlib.asynccontextmanager
async def scripted_workers(redis_url: str) -> AsyncIterator[Serve]:
    """`serve(role, worker_id, **script)` runs a ScriptedWorker on a free port and registers it
    (`address`: register a dead one); all are stopped on exit."""
    servers: list[grpc.aio.Server] = []
    regs: list[WorkerRegistration] = []

    async def start(
        role: str, worker_id: str, *, load: int = 0, address: str | None = None, **script: Any
    ) -> ScriptedWorker:
        worker = ScriptedWorker(**script)
        if address is None:
            server = grpc.aio.server()
            grpc_api.add_PrefillServicer_to_server(worker, server)
            grpc_api.add_DecodeServicer_to_server(worker, server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        rec = WorkerRecord(worker_id, role, address, MODEL, "L1", "agent")  # type: ignore[arg-type]
        reg = WorkerRegistration(redis_url, rec, lambda: Load(running=load), TOKEN)
        await reg.start()
        regs.append(reg)
        return worker

    try:
        yield start
    finally:
        for reg in regs:
            await reg.stop()
        for server in servers:
            await server.stop(grace=None)


async def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded except the final [DONE]."""
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


class Scripted:
    """A scripted prefill and decode pair: the reply each next request gets, the last prompt."""

    def __init__(self, prefill: Any, decode: Any) -> None:
        self.prefill, self.decode = prefill, decode

    def script(self, pieces: list[str]) -> None:
        self.prefill.first_text = pieces[0]
        self.decode.chunks, self.decode.decode_finish = tuple(pieces[1:]), pb.FINISH_REASON_STOP

    def last_prompt(self) -> list[int]:
        return list(self.prefill.prefill_requests[-1].prompt_token_ids)
