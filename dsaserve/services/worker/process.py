"""One prefill or decode worker process: the engine thread, the NIXL agent, the registry record,
the gRPC server with its cluster-token check, the HTTP probes, and (prefill) the stream of its
prefix cache's changes that routers route by.

`dsaserve prefill` / `dsaserve decode` build a `Worker` with the role's service class and serve
until SIGINT/SIGTERM (services/prefill/main.py, services/decode/main.py). A worker whose engine
thread or tensor-parallel rank dies leaves the registry and exits (`_watch_engine`,
LLMEngine.group_alive) rather than fail every request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.engine_loop import EngineLoop
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.prefix_cache.cache import CacheStats
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.structured import GrammarState
from dsaserve.engine.text.grammar import GrammarError
from dsaserve.services import connections
from dsaserve.services.auth import ClusterTokenCheck
from dsaserve.services.kv_events import CacheEventPublisher
from dsaserve.services.registry import Role, WorkerRecord, WorkerRegistration
from dsaserve.services.rpc import pb
from dsaserve.services.transfer import KVTransfer, Region, TransferStats
from dsaserve.services.transfer.interfaces import bind_ucx_to
from dsaserve.services.worker.convert import load_response
from dsaserve.services.worker.metrics import WorkerMetrics
from dsaserve.services.worker.probes import ProbeServer, probe_app
from dsaserve.services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_WATCH_S = 0.5  # how often the worker checks that its engine thread still runs
GRAMMAR_THREADS = 2  # grammars a worker compiles at once


class RoleService:
    """What the prefill and decode gRPC services have in common: Abort, Health, Load."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.active: set[str] = set()  # requests whose Prefill or Decode call runs

    def register(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def background(self) -> None:
        """Periodic work of the role (none by default); cancelled at shutdown."""

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        rid = request.request_id
        # Answered at once, never behind an engine step: the engine aborts the request (and frees
        # its pages) at its next command drain.
        found = self.let_go(rid)
        self.w.abort(rid)
        return pb.AbortResponse(found=found)

    def let_go(self, request_id: str) -> bool:
        """Forget what the service keeps for the request besides the engine's state; whether
        the worker had anything for it."""
        return request_id in self.active

    async def Health(self, request: pb.HealthRequest, context: object) -> pb.HealthResponse:
        return pb.HealthResponse(
            role=self.w.role, model=self.w.model_name, worker_id=self.w.worker_id
        )

    async def Load(self, request: pb.LoadRequest, context: object) -> pb.LoadResponse:
        return load_response(self.w.loop.load())


class Worker:
    """One prefill or decode worker process."""

    def __init__(self, settings: WorkerSettings, role: Role) -> None:
        self.settings, self.role = settings, role
        model_dir = settings.model or str(DEMO_MODEL_DIR)
        self.model_name = settings.served_model_name or os.path.basename(
            os.path.normpath(model_dir)
        )
        engine_config = settings.engine
        rank = (
            f"-dp{engine_config.data_parallel_rank}" if engine_config.data_parallel_size > 1 else ""
        )
        self.worker_id = (
            settings.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}{rank}"
        )
        wildcard = settings.host in ("0.0.0.0", "::")
        self.advertise_host = settings.advertise_host or (
            "127.0.0.1" if wildcard else settings.host
        )
        if not _is_loopback(settings.host) and settings.tls.cert is None:
            log.warning(
                "%s worker serves gRPC in plaintext and /metrics without authentication on %s: "
                "anyone who reaches it can read the cluster token; set --grpc-tls-cert/--key "
                "(and --grpc-tls-ca on every client) or bind a private interface",
                role,
                settings.host,
            )
        if role == "decode" and engine_config.kv_staging_memory_bytes is None:
            # A decode worker never holds a request for a reader: no staging blocks to keep.
            engine_config = dataclasses.replace(engine_config, kv_staging_memory_bytes=0)
        self.engine = LLMEngine(model_dir, engine_config)
        self.loop = EngineLoop(self.engine)
        cache = self.engine.prefix_cache
        self.metrics = WorkerMetrics(
            role,
            self.loop.load,
            lambda: cache.stats if cache is not None else CacheStats(),
            self.engine.speculator.stats if self.engine.speculator is not None else None,
            self.engine.model.counters,
        )
        bind_ucx_to(self.advertise_host)
        # NIXL is not thread-safe: one thread makes every call on the agent.
        self._nixl_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        # Grammars compile here, never on the engine's thread (llguidance drops the GIL while
        # it compiles): a long compile delays its own request, not the others' steps.
        self._grammar_threads = concurrent.futures.ThreadPoolExecutor(
            GRAMMAR_THREADS, thread_name_prefix="grammar"
        )
        regions = [Region(r.name, r.group, r.tensor) for r in self.engine.pool.regions()]
        # One agent name per process start: peers that cached a restarted worker's old agent
        # see a new name in its KV handles, never a stale connection under the old one.
        agent_name = f"{self.worker_id}.{uuid.uuid4().hex[:8]}"
        self.transfer: KVTransfer = self._nixl_thread.submit(
            KVTransfer, agent_name, regions
        ).result()
        # The hash names what makes a page mean the same bytes to a peer: the per-rank pool
        # layout. The tensor-parallel size is not in it (every rank holds the whole KV, so a
        # page is the same at any size and groups of different sizes pair); it is advertised
        # beside it, in the description that handles and errors carry.
        self.layout_hash = self.engine.pool.layout_hash()
        self.layout = (
            f"{self.engine.pool.layout_description()}, tensor-parallel "
            f"{engine_config.tensor_parallel_size} (KV whole on every rank; pulled from rank 0)"
        )
        if engine_config.data_parallel_size > 1:  # (each rank its own KV: a worker of its own)
            self.layout += (
                f", data-parallel rank {engine_config.data_parallel_rank} of "
                f"{engine_config.data_parallel_size}"
            )
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None  # set by serve()
        # Set once serve() begins to stop: open DecodeStreams refuse new requests and end.
        self.stopping = asyncio.Event()
        # READs in flight into a request's pages, by request id (services.worker.pull)
        self.reads: dict[str, concurrent.futures.Future[TransferStats]] = {}

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine, freeing its pages, once no READ writes into them (at
        once, or when the READ in flight ends: it cannot be stopped)."""
        read = self.reads.pop(request_id, None)
        if read is None:
            self.loop.call(self.engine.abort, request_id)
        else:  # (runs at once if the READ is over)
            read.add_done_callback(lambda _: self.loop.call(self.engine.abort, request_id))

    async def in_nixl_thread(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await asyncio.wrap_future(self.nixl_submit(fn, *args, **kwargs))

    def nixl_submit(
        self, fn: Callable[..., T], *args: object, **kwargs: object
    ) -> concurrent.futures.Future[T]:
        """Run fn on the NIXL thread; the future outlives a cancelled awaiter (a READ in flight
        cannot be stopped)."""
        return self._nixl_thread.submit(fn, *args, **kwargs)

    async def compile_grammar(self, params: SamplingParams) -> GrammarState | None:
        """The state of the request's grammar (None: it has none), compiled off the engine's
        thread; RequestError if it does not compile."""
        if params.grammar is None:
            return None
        compile_ = functools.partial(self.engine.constraints.state, params.grammar)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._grammar_threads, compile_)
        except GrammarError as e:
            raise RequestError(f"the grammar does not compile: {e}") from None

    async def serve(self, service: RoleService) -> None:
        s = self.settings
        self.loop.start()
        server = grpc.aio.server(
            interceptors=[ClusterTokenCheck(s.cluster_token)], options=connections.SERVER_OPTIONS
        )
        service.register(server)
        port = connections.bind(server, f"{s.host}:{s.port}", s.tls)
        await server.start()
        self.address = f"{self.advertise_host}:{port}"
        record = WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            model=self.model_name,
            layout_hash=self.layout_hash,
            nixl_agent=self.transfer.agent_name,
        )
        registration = WorkerRegistration(
            s.redis_url, record, self.loop.load, s.cluster_token, s.registry_ttl_s
        )
        probes = None
        if s.metrics_port:
            ready = lambda: self.ready.is_set() and self.loop.alive
            probes = ProbeServer(probe_app(ready, self.metrics.registry), s.host, s.metrics_port)
            probes.start()
        stop = self._stop = asyncio.Event()  # from here SIGTERM/SIGINT stop the worker cleanly
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(service.background())]
        await registration.start()
        publisher = self._cache_publisher()
        self.ready.set()
        log.info(
            "%s worker %s serving %s on %s (layout %s)",
            self.role,
            self.worker_id,
            self.model_name,
            record.address,
            self.layout,
        )
        tasks.append(asyncio.create_task(self._watch_engine(stop)))
        await stop.wait()
        log.info("%s worker %s stopping", self.role, self.worker_id)
        self.stopping.set()
        self.ready.clear()
        await registration.stop()  # leave routing first
        if publisher is not None:
            await publisher.stop()
        await server.stop(grace=5)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.loop.stop()
        self.engine.close()
        await self.in_nixl_thread(self.transfer.close)
        self._nixl_thread.shutdown()
        self._grammar_threads.shutdown(cancel_futures=True)
        if probes is not None:
            probes.stop()

    def stop(self) -> None:
        """Stop serving, as SIGTERM does (from the event loop that runs `serve`)."""
        if self._stop is not None:
            self._stop.set()

    def _cache_publisher(self) -> CacheEventPublisher | None:
        """A worker tells routers what its prefix cache holds (services.kv_events): a prefill
        worker's resumes prompts, a decode worker's the conversations it decoded."""
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        publisher = CacheEventPublisher(
            self.settings.redis_url,
            self.worker_id,
            self.transfer.agent_name,  # one per process start
            cache.salt,
            cache.block,
            lambda snapshot: self.loop.run(cache.take_events, snapshot),
        )
        publisher.start()
        return publisher

    async def _watch_engine(self, stop: asyncio.Event) -> None:
        """A dead engine thread, or a dead rank of its tensor-parallel group, cannot serve:
        leave the registry rather than fail every request."""
        while self.loop.alive:
            await asyncio.sleep(ENGINE_WATCH_S)
        if not self.engine.group_alive():
            log.error("a tensor-parallel rank of the engine died; shutting down")
        else:
            log.error("engine thread died (%r); shutting down", self.loop.failure)
        stop.set()


def now_ms() -> int:
    return int(time.time() * 1000)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
