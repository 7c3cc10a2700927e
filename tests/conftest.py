"""Shared fixtures: real services on free loopback ports, each wait bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
import pytest_asyncio
import redis

# First of all: without CUDA, kernels.env must set TRITON_INTERPRET before any module imports
# triton (triton reads it once), or every Triton kernel a test launches on CPU fails.
from dsaserve import kernels  # noqa: F401
from dsaserve.engine.ports import free_port
from dsaserve.services import redis_server as redis_launcher
from tests.model_fixtures import family, release, tiny  # noqa: F401  (fixtures, shared with GPU runs)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from dsaserve.services.router.settings import RouterSettings
    from tests.model_fixtures import Family
    from tests.scripted_worker import Serve
    from tests.serving_stack import Stack

REDIS_START_TIMEOUT_S = 10.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `unit` every test that is neither `e2e` nor `gpu`, so `-m unit` runs them alone."""
    for item in items:
        if item.get_closest_marker("e2e") is None and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.unit)


def _start_redis(log: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = port or free_port()
    proc = subprocess.Popen(
        redis_launcher.command(port, "--logfile", str(log)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = redis_launcher.url(port)
    if redis_launcher.wait_ready(proc, url, REDIS_START_TIMEOUT_S):
        return proc, url
    proc.kill()
    proc.wait(timeout=5)
    tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
    raise RuntimeError(f"redis-server on port {port} did not start: {tail}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server (no persistence) for the session; yields its URL."""
    try:
        redis_launcher.binary()
    except redis_launcher.RedisNotFound as e:
        pytest.fail(str(e))
    proc, url = _start_redis_retrying(tmp_path_factory.mktemp("redis") / "redis.log")
    yield url
    _stop(proc)


def _start_redis_retrying(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    try:
        return _start_redis(log)
    except RuntimeError:  # the free port was taken in between: one more try on a new port
        return _start_redis(log)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass
class PrivateRedis:
    """A redis-server of one test's own, which the test may pause to make Redis unreachable."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def restart(self) -> None:
        """Stop the server and start a fresh one on the same port: every key is lost and every
        connection closed, as when a Redis restarts."""
        self.resume()
        _stop(self.proc)
        port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        self.proc, _ = _start_redis(self.log, port)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and commands hang, as on a stuck or partitioned Redis."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server for this test alone; resumed if paused, and stopped, at teardown."""
    log = tmp_path / "private-redis.log"
    proc, url = _start_redis_retrying(log)
    server = PrivateRedis(url, proc, log)
    yield server
    server.resume()
    _stop(server.proc)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's redis-server with an empty database, for tests that need a clean registry."""
    client = redis.Redis.from_url(redis_server, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest,
    family: Family,  # noqa: F811  (the fixture, imported above)
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The module's serving stack (workers and router as processes), healthy, as the module's
    STACK (tests/serving_stack.py's StackSpec) describes it; by default one prefill worker, one
    decode worker and a router on `tiny`. Stopped after the module, or before a test of another
    family (its checkpoint is `family`'s)."""
    from tests.serving_stack import StackSpec, serving

    spec: StackSpec = getattr(request.module, "STACK", StackSpec())
    model = request.getfixturevalue(spec.model) if isinstance(spec.model, str) else spec.model
    with serving(spec, model, redis_server, tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    """An OpenAI client of the module's serving stack (`stack`)."""
    from tests.serving_stack import openai_client

    with openai_client(stack.url) as c:
        yield c


# ---------------------------------------------------------------- router


@pytest.fixture
def router_model_dir(tmp_path: Path) -> Path:
    """A model dir the router can serve: config.json (64-token context) + the tiny tokenizer."""
    from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer

    model_dir = tmp_path / "tiny-router-model"
    write_byte_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    return model_dir


@pytest.fixture
def v4_router_model_dir(tmp_path: Path) -> Path:
    """A V4 checkpoint as the router sees it: the release's tokenizer (every V4 marker, no chat
    template) and a deepseek_v4 config.json, so chats go through the release's encoder."""
    from dsaserve.engine.text.byte_tokenizer import write_byte_tokenizer

    model_dir = tmp_path / "tiny-v4-router-model"
    write_byte_tokenizer(model_dir, release=True)
    config = {"model_type": "deepseek_v4", "max_position_embeddings": 4096}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@dataclass
class RunningRouter:
    url: str  # http://127.0.0.1:<port>
    app: FastAPI
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    async def refresh_registry(self) -> None:
        """See registry changes now instead of at the watcher's next periodic refresh."""
        await self.app.state.router.watcher.refresh()

    def openai(self, api_key: str = "none") -> openai.AsyncOpenAI:
        """An official OpenAI client for this router (no retries; closed at teardown)."""
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client


@pytest_asyncio.fixture
async def start_router() -> AsyncIterator[Callable[[RouterSettings], Awaitable[RunningRouter]]]:
    """Start routers on free ports inside the test's event loop (real HTTP via uvicorn)."""
    import uvicorn  # imported here so one broken service cannot stop every test from collecting

    from dsaserve.services.router import http_server
    from dsaserve.services.router.app import create_app

    running: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []
    routers: list[RunningRouter] = []

    async def start(config: RouterSettings) -> RunningRouter:
        app = create_app(config)
        port = free_port()
        at = dataclasses.replace(config, host="127.0.0.1", port=port)
        server = uvicorn.Server(http_server.config(app, at, log_level="warning"))
        task = asyncio.create_task(server.serve())
        running.append((server, task))
        deadline = time.monotonic() + 10
        while not server.started:
            if task.done():
                task.result()  # raises the startup error
                pytest.fail("uvicorn exited during startup")
            if time.monotonic() > deadline:
                pytest.fail("router did not start within 10 s")
            await asyncio.sleep(0.01)  # polling a readiness flag, bounded by the deadline
        routers.append(RunningRouter(f"http://127.0.0.1:{port}", app))
        return routers[-1]

    yield start
    for client in (c for router in routers for c in router.clients):
        await client.close()
    for server, _ in running:
        server.should_exit = True
    await asyncio.wait_for(
        asyncio.gather(*(task for _, task in running), return_exceptions=True), timeout=15
    )


# ---------------------------------------------------------------- scripted workers


@pytest_asyncio.fixture
async def serve(redis_url: str) -> AsyncIterator[Serve]:
    """Start ScriptedWorkers (tests/scripted_worker.py): `await serve(role, worker_id, ...)`."""
    from tests.scripted_worker import scripted_workers

    async with scripted_workers(redis_url) as start:
        yield start


@pytest_asyncio.fixture
async def make_router(
    start_router: Callable[[RouterSettings], Awaitable[RunningRouter]],
    router_model_dir: Path,
    redis_url: str,
) -> Callable[..., Awaitable[RunningRouter]]:
    """`await make_router(model_dir=..., **settings)`: a router that sees the scripted workers
    (the tiny router model unless `model_dir` is given; the same served name either way)."""
    from dsaserve.services.router.settings import RouterSettings
    from tests.scripted_worker import MODEL, TOKEN

    async def make(model_dir: Path = router_model_dir, **config: object) -> RunningRouter:
        settings = {"served_model_name": MODEL, "cluster_token": TOKEN, **config}
        router = await start_router(RouterSettings(str(model_dir), redis_url, **settings))
        await router.refresh_registry()
        return router

    return make
