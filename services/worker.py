"""What a prefill and a decode worker share: the engine thread, the NIXL agent, the registry
record, the gRPC server with its cluster-token check, and the HTTP probes and metrics.

`dsaserve prefill` / `dsaserve decode` build a `Worker` and serve until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

import grpc

from engine.engine import EngineConfig, LLMEngine
from engine.engine_loop import EngineLoop
from engine.sampling import SamplingParams
from engine.tiny_model import default_tiny_model_dir
from services.metrics import exposition
from services.registry import (
    DEFAULT_TTL_S,
    WorkerLoad,
    WorkerRecord,
    WorkerRegistration,
)
from services.rpc import pb
from services.transfer import KVTransfer, Region, publish_descriptor
from services.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
TOKEN_METADATA_KEY = "x-dsaserve-cluster-token"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--served-model-name", help="model id in the registry (default: the model dir's name)")
    parser.add_argument("--host", default="0.0.0.0", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port")
    parser.add_argument("--advertise-host", default=None, help="host other processes reach this worker at")
    parser.add_argument("--worker-id", default=None, help="registry id (default: role-hostname-random)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--cluster-token", default="", help="shared secret every internal call must carry")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes (default: share of GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--registry-ttl", type=float, default=DEFAULT_TTL_S)
    parser.add_argument("--metrics-port", type=int, default=9100, help="HTTP /metrics, /live, /ready (0 = off)")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="prefill: how long KV waits for a reader")
    parser.add_argument("--transfer-timeout", type=float, default=60.0, help="decode: bound on one KV pull")


def add_prefill_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)
    parser.set_defaults(port=50052, metrics_port=9101)


def run_prefill(args: argparse.Namespace) -> None:
    from services.prefill.service import PrefillService

    asyncio.run(Worker(args, "prefill").serve(PrefillService))


def run_decode(args: argparse.Namespace) -> None:
    from services.decode.service import DecodeService

    asyncio.run(Worker(args, "decode").serve(DecodeService))


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Apply the proto's documented defaults; raises ValueError for invalid values."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class Worker:
    """One prefill or decode worker process."""

    def __init__(self, args: argparse.Namespace, role: str) -> None:
        if not args.cluster_token:
            raise SystemExit("--cluster-token (or DSASERVE_CLUSTER_TOKEN) is required: workers reject calls without it")
        self.args, self.role = args, role
        model_dir = args.model or str(default_tiny_model_dir())
        self.model_name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
        self.worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.engine = LLMEngine(model_dir, EngineConfig(
            device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, page_size=args.page_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            context_length=args.context_length, cuda_graphs=not args.no_cuda_graphs))
        self.loop = EngineLoop(self.engine)
        self.metrics = WorkerMetrics(role, self.loop)
        # NIXL is not thread-safe: one thread makes every call on the agent.
        self._nixl_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        regions = [Region(r.name, r.group, r.tensor) for r in self.engine.pool.regions()]
        self.transfer: KVTransfer = self._nixl_thread.submit(KVTransfer, self.worker_id, regions).result()
        self.layout_hash = self.engine.pool.layout_hash()
        self.layout = self.engine.pool.layout_description()
        self.ready = threading.Event()

    async def in_nixl_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.wrap_future(self._nixl_thread.submit(fn, *args, **kwargs))

    def registry_load(self) -> WorkerLoad:
        s = self.loop.load()
        return WorkerLoad(running=s.running, waiting=s.waiting, free_blocks=s.free_blocks,
                          total_blocks=s.total_blocks, held=s.held)

    def load_response(self) -> pb.LoadResponse:
        s = self.loop.load()
        return pb.LoadResponse(running=s.running, waiting=s.waiting, free_blocks=s.free_blocks,
                               total_blocks=s.total_blocks, held=s.held)

    def health_response(self) -> pb.HealthResponse:
        return pb.HealthResponse(role=self.role, model=self.model_name, worker_id=self.worker_id)

    async def serve(self, service_cls) -> None:
        args = self.args
        self.loop.start()
        service = service_cls(self)
        server = grpc.aio.server(interceptors=[_ClusterTokenCheck(args.cluster_token)],
                                 options=[("grpc.max_receive_message_length", 64 << 20)])
        service.register(server)
        port = server.add_insecure_port(f"{args.host}:{args.port}")
        await server.start()
        advertise = args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host)
        record = WorkerRecord(worker_id=self.worker_id, role=self.role, address=f"{advertise}:{port}",
                              model=self.model_name, layout_hash=self.layout_hash, nixl_agent=self.worker_id)
        ttl = args.registry_ttl
        registration = WorkerRegistration(args.redis_url, record, self.registry_load, ttl,
                                          on_beat=lambda r: publish_descriptor(r, self.transfer, 2 * ttl))
        http = _start_probe_server(args.host, args.metrics_port, self) if args.metrics_port else None
        # Periodic work of the role, if any (prefill: releasing read or expired KV).
        tasks = [asyncio.create_task(service.background())] if hasattr(service, "background") else []
        await registration.start()
        self.ready.set()
        log.info("%s worker %s serving %s on %s (layout %s)", self.role, self.worker_id, self.model_name,
                 record.address, self.layout)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        tasks.append(asyncio.create_task(self._watch_engine(stop)))
        await stop.wait()
        log.info("%s worker %s stopping", self.role, self.worker_id)
        self.ready.clear()
        await registration.stop()                 # leave routing first
        await server.stop(grace=5)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.loop.stop()
        await self.in_nixl_thread(self.transfer.close)
        self._nixl_thread.shutdown()
        if http is not None:
            http.shutdown()

    async def _watch_engine(self, stop: asyncio.Event) -> None:
        """A dead engine thread cannot serve: leave the registry instead of failing every request."""
        while self.loop.alive:
            await asyncio.sleep(0.5)
        log.error("engine thread died (%r); shutting down", self.loop.failure)
        stop.set()


class _ClusterTokenCheck(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

        async def reject(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_METADATA_KEY} metadata")

        self._reject = reject

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get(TOKEN_METADATA_KEY) == self._token:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            async def reject_stream(request, context):
                await self._reject(request, context)
                yield  # pragma: no cover - abort raises
            return grpc.unary_stream_rpc_method_handler(reject_stream)
        return grpc.unary_unary_rpc_method_handler(self._reject)


def _start_probe_server(host: str, port: int, worker: Worker) -> ThreadingHTTPServer:
    """/metrics (Prometheus), /live (the process answers), /ready (registered, engine alive)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            if self.path == "/metrics":
                body, ctype = exposition(worker.metrics.registry)
                status = 200
            elif self.path == "/live":
                body, ctype, status = b"ok\n", "text/plain", 200
            elif self.path == "/ready":
                ok = worker.ready.is_set() and worker.loop.alive
                body, ctype, status = (b"ready\n" if ok else b"not ready\n"), "text/plain", 200 if ok else 503
            else:
                body, ctype, status = b"not found\n", "text/plain", 404
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:   # keep probes out of the logs
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


def now_ms() -> int:
    return int(time.time() * 1000)
