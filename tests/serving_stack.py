"""Real dsaserve processes for end-to-end tests: workers and a router as subprocesses.

Every wait polls a readiness condition under a deadline; processes are killed at teardown.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai

from dsaserve.engine.llm import LLM
from dsaserve.engine.ports import free_port
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.services.auth import token_metadata
from dsaserve.services.rpc import grpc_api, pb

TOKEN = "e2e-cluster-token"
START_TIMEOUT_S = 120.0


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll `condition()` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)  # polling a condition, bounded by the deadline


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    port: int
    metrics_port: int = 0
    credentials: grpc.ChannelCredentials | None = None  # TLS to this worker (None: plaintext)
    server_name: str | None = None  # the name its certificate carries, if not its address

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
            )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def load(self) -> pb.LoadResponse:
        stub = grpc_api.PrefillStub if self.name.startswith("prefill") else grpc_api.DecodeStub
        channel = (
            grpc.insecure_channel(self.address)
            if self.credentials is None
            else grpc.secure_channel(
                self.address,
                self.credentials,
                options=[("grpc.ssl_target_name_override", self.server_name)]
                if self.server_name
                else None,
            )
        )
        with channel:
            return stub(channel).Load(pb.LoadRequest(), metadata=token_metadata(TOKEN), timeout=5)

    def counter(self, name: str, **labels: str) -> float:
        """This worker's counter `name` with these labels (0 before the first count)."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.split("{")[0].split(" ")[0] == name and all(
                f'{k}="{v}"' in line for k, v in labels.items()
            ):
                return float(line.split()[-1])
        return 0.0

    def failures(self, cause: str) -> float:
        """This worker's dsaserve_worker_failures_total for `cause` (0 before the first)."""
        return self.counter("dsaserve_worker_failures_total", cause=cause)

    def all_kv_free(self) -> bool:
        load = self.load()
        return (
            load.free_pages + load.cached_pages == load.total_pages
            and load.running == load.waiting == load.held == 0
        )


def wait_all_kv_free(*workers: Proc, timeout: float = 20) -> None:
    """Every worker ends with all its KV pages free and no request left."""
    for worker in workers:
        wait_for(worker.all_kv_free, timeout, f"{worker.name} to free all KV")


def slow_profile(path: Path, decode_step_ms: float, prefill_tok_s: float = 1e6) -> Path:
    """A --simulate profile whose decode steps take `decode_step_ms` whatever the batch, and
    whose prompts run at `prefill_tok_s` tokens a second: a worker slowed on purpose."""
    rows = [
        {"concurrency": n, "context": ctx, "step_ms": decode_step_ms}
        for n in (1, 2, 4)
        for ctx in (16, 256)
    ]
    path.write_text(json.dumps({"decode": rows, "prefill_tok_s": {"64": prefill_tok_s}}))
    return path


def router_health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def refresh_age(url: str) -> float:
    """Seconds since the router at `url` last read the registry."""
    return router_health(url)["registry"]["last_refresh_age_s"]


def wait_for_a_refresh(url: str) -> None:
    """Until the router's registry refresh age drops: it refreshed since the call."""
    last = [refresh_age(url)]

    def refreshed() -> bool:
        age = refresh_age(url)
        dropped, last[0] = age < last[0], age
        return dropped

    wait_for(refreshed, 30, "the router's next refresh")


def openai_client(url: str) -> openai.OpenAI:
    """The openai client against a router at `url`: no retries, so each error is seen once."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline_generate(model: Path, messages: list[dict], max_tokens: int, *flags: str) -> dict:
    """`dsaserve generate --chat` in its own process, greedy: its JSON answer."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsaserve.services.cli",
            "generate",
            "--model",
            str(model),
            "--chat",
            json.dumps(messages),
            "--max-tokens",
            str(max_tokens),
            "--temperature",
            "0",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=START_TIMEOUT_S,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass
class Stack:
    model: Path
    redis_url: str
    workdir: Path
    ttl: float = 6.0
    procs: list[Proc] = field(default_factory=list)

    def _spawn(self, name: str, argv: list[str], port: int, metrics_port: int = 0) -> Proc:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "DSASERVE_CLUSTER_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsaserve.services.cli", *argv],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs.append(Proc(name, proc, log, port, metrics_port))
        return self.procs[-1]

    def worker(self, role: str, *extra: str, port: int = 0, metrics_port: int = 0) -> Proc:
        """Start a worker (on free ports unless given: a restart keeps its address)."""
        port, metrics_port = port or free_port(), metrics_port or free_port()
        name = f"{role}-{len(self.procs)}"
        return self._spawn(
            name,
            [
                role,
                "--model",
                str(self.model),
                "--redis-url",
                self.redis_url,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--worker-id",
                name,
                "--registry-ttl",
                str(self.ttl),
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--max-num-seqs",
                "32",
                "--max-num-batched-tokens",
                "1024",
                *extra,
            ],
            port,
            metrics_port,
        )

    def router(self, *extra: str) -> Proc:
        port = free_port()
        return self._spawn(
            "router",
            [
                "router",
                "--model",
                str(self.model),
                "--redis-url",
                self.redis_url,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--registry-ttl",
                str(self.ttl),
                *extra,
            ],
            port,
        )

    def wait_ready(self, *procs: Proc) -> None:
        def ready() -> bool:
            for p in procs:
                p.check_alive()
            return all(
                http_status(f"http://127.0.0.1:{p.metrics_port}/ready") == 200
                for p in procs
                if p.metrics_port
            )

        wait_for(ready, START_TIMEOUT_S, "workers to become ready")

    def wait_healthy(self, router: Proc, **workers: int) -> str:
        """The router's URL once it reports healthy and, per role given (`prefill=2`), sees at
        least that many workers: a router is healthy with one pair, before it has seen them all."""
        url = f"http://127.0.0.1:{router.port}"

        def healthy() -> bool:
            for p in self.procs:
                p.check_alive()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    seen = json.load(r)["workers"]
            except (urllib.error.URLError, OSError):
                return False
            return all(seen[role] >= n for role, n in workers.items())

        wait_for(healthy, START_TIMEOUT_S, "the router to report healthy")
        return url

    def kill(self, proc: Proc) -> None:
        """SIGKILL one process and stop watching it (a crash the test causes on purpose)."""
        proc.proc.kill()
        proc.proc.wait(timeout=10)
        self.procs.remove(proc)

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs:
            try:
                p.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=10)


@dataclass(frozen=True)
class StackSpec:
    """A module's serving stack, as conftest's `stack` fixture reads it from the module's STACK:
    its checkpoint (a fixture's name, or a model directory), its workers and flags, and the
    Redis database its workers register in (a registry of the module's own)."""

    model: str | Path = "tiny"
    prefill: int = 1
    decode: int = 1
    worker_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()
    db: int = 0


def in_db(redis_url: str, db: int) -> str:
    """The same Redis server, database `db`."""
    return f"{redis_url.rsplit('/', 1)[0]}/{db}"


@contextlib.contextmanager
def serving(spec: StackSpec, model: Path, redis_url: str, workdir: Path) -> Iterator[Stack]:
    """spec's prefill workers, decode workers and router, healthy: the stack's `url`, `workers`
    (prefill first), `prefill` and `decode` (the first of each); stopped on leaving."""
    s = Stack(model, in_db(redis_url, spec.db), workdir)
    try:
        roles = ["prefill"] * spec.prefill + ["decode"] * spec.decode
        workers = [s.worker(role, *spec.worker_flags) for role in roles]
        router = s.router(*spec.router_flags)
        s.wait_ready(*workers)
        s.url = s.wait_healthy(router, prefill=spec.prefill, decode=spec.decode)
        s.workers = workers
        s.prefill, s.decode = workers[0], workers[spec.prefill]
        yield s
    finally:
        s.stop()


# A tool whose forced call ends within bounded tokens: random weights never close a free string.
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["days"],
            "additionalProperties": False,
        },
    },
}


def served_completion(
    client: openai.OpenAI, prompt: list[int], uncached: LLM, max_tokens: int = 8
) -> tuple[int, list[int]]:
    """Complete `prompt` greedily through a stack, with 5 logprobs a token; its answer (text,
    each token's logprob) must be the engine's without a prefix cache. Returns (the cached
    prompt tokens, the answer's token ids)."""
    r = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=5,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5)
    want = uncached.generate([prompt], params)[0]
    got = r.choices[0]
    assert got.text == want.text
    assert want.logprobs is not None
    for served, offline in zip(got.logprobs.token_logprobs, want.logprobs, strict=True):
        assert math.isclose(served, offline.logprob, abs_tol=1e-4), (served, offline.logprob)
    return r.usage.prompt_tokens_details.cached_tokens, want.token_ids
