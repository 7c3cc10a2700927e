"""Soak test: N streaming users for T minutes against a local stack, with faults on a schedule.

    python -m loadtest.soak --users 32 --minutes 10 --output results/soak.json

Starts its own stack (redis-server, one prefill worker, one decode worker, the router; the
built-in model unless --model), so it can break it: by default, spread over the run, it kills the
decode worker (-9, restarted after a pause), kills the prefill worker, stops Redis (SIGSTOP, then
SIGCONT) and hangs the decode worker (SIGSTOP, then SIGCONT). Restarted workers keep their id and
address, as a container restart does. `--fault KIND@SECONDS:DURATION` replaces the schedule.

A share of the requests (--disconnect-fraction) hang up on purpose after a random moment of up
to --disconnect-within seconds: while queued, in prefill, during the KV pull or while decoding;
the stack must abort them on both workers and leak nothing. Every other request must end,
either answered or with a clear error (an HTTP status or an error event in the stream); none
may hang past its timeout. At the end the load stops, the leases and TTLs
run out, and the report gives: requests by outcome, latency percentiles of the answered ones,
each process's memory (RSS) over the run, and each worker's KV pages free at start and end
(leaked = total - free - cached once idle: pages only the prefix cache holds are not leaked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsaserve.engine.ports import free_port
from loadtest.bench_serving import BenchConfig, describe, send_request
from loadtest.prompts import make_prompt

FAULTS = ("kill-decode", "kill-prefill", "stop-redis", "hang-decode")
RSS_EVERY_S = 5.0
TOKEN = "soak-cluster-token"


@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULTS
    at_s: float  # seconds after the load starts
    duration_s: float  # how long the process stays dead or stopped

    @classmethod
    def parse(cls, text: str) -> Fault:
        m = re.fullmatch(r"([a-z-]+)@([\d.]+):([\d.]+)", text)
        if not m or m.group(1) not in FAULTS:
            raise ValueError(f"fault {text!r}: expected KIND@SECONDS:DURATION, KIND in {FAULTS}")
        return cls(m.group(1), float(m.group(2)), float(m.group(3)))


def default_schedule(seconds: float) -> list[Fault]:
    """The four faults, evenly spread, each lasting 15 s (20 s for the hang)."""
    step = seconds / 5
    return [
        Fault("kill-decode", step, 15.0),
        Fault("kill-prefill", 2 * step, 15.0),
        Fault("stop-redis", 3 * step, 15.0),
        Fault("hang-decode", 4 * step, 20.0),
    ]


@dataclass
class Process:
    name: str
    argv: list[str]
    metrics_port: int = 0
    env: Mapping[str, str] = field(default_factory=dict)  # on top of ours (e.g. the GPU)
    cwd: str | None = None  # where it runs (its code, for `python -m`): None, here
    popen: subprocess.Popen | None = None
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (t, RSS), this process

    def start(self, log_dir: Path) -> None:
        log = (log_dir / f"{self.name}.log").open("a")
        env = {**os.environ, "DSASERVE_CLUSTER_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", **self.env}
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd
        )

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def sample_rss(self, t: float) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            status = Path(f"/proc/{self.popen.pid}/status").read_text()
        except OSError:
            return
        kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        self.rss_mib.append((t, kib / 1024))

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class LocalStack:
    """redis-server, prefill, decode and router on loopback, each restartable by name.

    role_env: per-role environment (bench/disagg.py puts each worker on its own GPU)."""

    def __init__(
        self,
        model: str,
        log_dir: Path,
        engine_flags: Sequence[str],
        lease_s: float,
        role_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.log_dir = log_dir
        redis_port, self.router_port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        cli = [sys.executable, "-m", "dsaserve.services.cli"]
        common = ["--model", model, "--redis-url", self.redis_url, "--registry-ttl", "3"]
        self.procs: dict[str, Process] = {
            "redis": Process("redis", ["redis-server", "--port", str(redis_port), "--bind",
                                       "127.0.0.1", "--save", "", "--appendonly", "no"]),
        }  # fmt: skip
        for role in ("prefill", "decode"):
            metrics = free_port()
            argv = cli + [role, *common, "--port", str(free_port()), "--metrics-port",
                          str(metrics), "--worker-id", f"soak-{role}", *engine_flags]  # fmt: skip
            if role == "prefill":
                argv += ["--lease-seconds", str(lease_s)]
            self.procs[role] = Process(role, argv, metrics, (role_env or {}).get(role, {}))
        self.procs["router"] = Process(
            "router", cli + ["router", *common, "--port", str(self.router_port)]
        )
        self.url = f"http://127.0.0.1:{self.router_port}"

    def start(self, timeout_s: float = 300.0) -> None:
        for p in self.procs.values():
            p.start(self.log_dir)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            for p in self.procs.values():
                if p.popen.poll() is not None:
                    raise SystemExit(f"{p.name} exited; see {self.log_dir / p.name}.log")
            if time.monotonic() > deadline:
                raise SystemExit(f"the stack was not healthy within {timeout_s:.0f} s")
            time.sleep(0.25)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def worker_pages(self, role: str) -> dict[str, float]:
        """free/total pages and held/running/waiting requests, from the worker's /metrics."""
        port = self.procs[role].metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        names = {
            "dsaserve_kv_pages_free": "free",
            "dsaserve_kv_pages_total": "total",
            "dsaserve_kv_pages_cached": "cached",
            "dsaserve_requests_held": "held",
            "dsaserve_requests_running": "running",
            "dsaserve_requests_waiting": "waiting",
        }
        out = {}
        for line in text.splitlines():
            name = line.split("{")[0]
            if name in names:
                out[names[name]] = float(line.split()[-1])
        return out

    async def inject(self, fault: Fault, events: list[dict[str, Any]], t0: float) -> None:
        await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - t0)))
        action, role = fault.kind.split("-")
        proc = self.procs[role]
        events.append({"t": round(time.monotonic() - t0, 1), "fault": fault.kind, "begin": True})
        if action == "kill":
            proc.signal(signal.SIGKILL)
            proc.popen.wait()
            await asyncio.sleep(fault.duration_s)
            proc.start(self.log_dir)  # same id, same ports
        else:  # stop / hang: the process stays, frozen
            proc.signal(signal.SIGSTOP)
            await asyncio.sleep(fault.duration_s)
            proc.signal(signal.SIGCONT)
        events.append({"t": round(time.monotonic() - t0, 1), "fault": fault.kind, "begin": False})

    def stop(self) -> None:
        for name in ("router", "decode", "prefill", "redis"):
            proc = self.procs[name]
            if proc.popen is not None and proc.popen.poll() is None:
                proc.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.stop()


@dataclass
class SoakConfig:
    users: int = 32
    seconds: float = 600.0
    faults: list[Fault] | None = None  # None: default_schedule(seconds)
    model: str | None = None  # None: the built-in model
    prompt_words: tuple[int, int] = (8, 200)
    output_tokens: tuple[int, int] = (8, 64)
    request_timeout_s: float = 120.0
    # Room for the users' batch (the default 256 sequences cost more fixed KV than this budget),
    # and prefill chunks that keep a CPU step to seconds: a Claim or Release waits for the step.
    engine_flags: tuple[str, ...] = (
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "1024",
    )
    lease_s: float = 8.0  # the prefill worker's --lease-seconds
    disconnect_fraction: float = 0.25  # requests whose client hangs up on purpose...
    disconnect_within_s: float = 3.0  # ...after a random moment of up to this
    quiet_s: float = 16.0  # after the load: leases and registry TTLs run out
    log_dir: str | None = None


async def _user(
    client: httpx.AsyncClient, cfg: SoakConfig, model: str, end: float, rng: random.Random
) -> tuple[list[Any], int]:
    """This user's requests' records, and how many it hung up on on purpose."""
    records, disconnected = [], 0
    while time.monotonic() < end:
        words = rng.randint(*cfg.prompt_words)
        prompt, output_len = make_prompt(words, rng), rng.randint(*cfg.output_tokens)
        sending = send_request(client, BenchConfig(), model, prompt, output_len)
        if rng.random() < cfg.disconnect_fraction:
            try:  # the client leaves at some stage of the request, closing its connection
                async with asyncio.timeout(rng.uniform(0.0, cfg.disconnect_within_s)):
                    records.append(await sending)
            except TimeoutError:
                disconnected += 1
            continue
        record = await sending
        records.append(record)
        if not record.ok:
            await asyncio.sleep(0.5)  # back off a little, as a well-behaved client does
    return records, disconnected


def _outcome(record: Any) -> str:
    if record.ok:
        return "ok"
    error = record.error or ""
    m = re.match(r"HTTP (\d+)", error)
    if m:
        return f"HTTP {m.group(1)}"
    if error.startswith("error event"):
        return "error event in stream"
    return error.split(":")[0]  # httpx exception class: a dropped or timed-out connection


async def _run(cfg: SoakConfig, stack: LocalStack) -> dict[str, Any]:
    rng = random.Random(0)
    faults = cfg.faults if cfg.faults is not None else default_schedule(cfg.seconds)
    pages_before = {role: stack.worker_pages(role) for role in ("prefill", "decode")}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=cfg.users + 4)
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()
        end = t0 + cfg.seconds

        async def sample_rss() -> None:
            while True:
                for p in stack.procs.values():
                    p.sample_rss(time.monotonic() - t0)
                await asyncio.sleep(RSS_EVERY_S)

        sampler = asyncio.create_task(sample_rss())
        injections = [asyncio.create_task(stack.inject(f, events, t0)) for f in faults]
        users = [
            _user(client, cfg, model, end, random.Random(rng.random())) for _ in range(cfg.users)
        ]
        batches = await asyncio.gather(*users)
        records = [r for batch, _ in batches for r in batch]
        disconnected = sum(n for _, n in batches)
        await asyncio.gather(*injections)
        duration = time.monotonic() - t0
        await asyncio.sleep(cfg.quiet_s)
        sampler.cancel()
    pages_after = {role: stack.worker_pages(role) for role in ("prefill", "decode")}
    ok = [r for r in records if r.ok]
    return {
        "config": {"users": cfg.users, "seconds": cfg.seconds, "faults": [vars(f) for f in faults]},
        "duration_s": round(duration, 1),
        "requests": len(records) + disconnected,
        "disconnected": disconnected,
        "outcomes": dict(Counter(map(_outcome, records)).most_common()),
        "errors": dict(Counter(r.error[:120] for r in records if not r.ok).most_common(8)),
        "hung": sum(r.latency is not None and r.latency >= cfg.request_timeout_s for r in records),
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None], (50, 90, 99)),
        "e2e_ms": describe([r.latency for r in ok if r.latency is not None], (50, 90, 99)),
        "rss_mib": {
            name: {
                "first": round(p.rss_mib[0][1], 1) if p.rss_mib else None,
                "last": round(p.rss_mib[-1][1], 1) if p.rss_mib else None,
                "max": round(max(v for _, v in p.rss_mib), 1) if p.rss_mib else None,
            }
            for name, p in stack.procs.items()
        },
        "pages_before": pages_before,
        "pages_after": pages_after,
        "leaked_pages": {
            r: p["total"] - p["free"] - p.get("cached", 0) for r, p in pages_after.items()
        },
        "fault_events": events,
    }


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Start a stack, load it with faults, stop it; the report as a dict."""
    from dsaserve.engine.demo_model import DEMO_MODEL_DIR

    log_dir = Path(cfg.log_dir or f"/tmp/dsaserve-soak-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(cfg.model or str(DEMO_MODEL_DIR), log_dir, cfg.engine_flags, cfg.lease_s)
    try:
        stack.start()
        return asyncio.run(_run(cfg, stack)) | {"logs": str(log_dir)}
    finally:
        stack.stop()


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"soak: {result['config']['users']} users, {result['duration_s']} s, "
        f"{result['requests']} requests ({result['disconnected']} hung up by their clients), "
        f"hung {result['hung']}",
        "outcomes: " + ", ".join(f"{k}: {v}" for k, v in result["outcomes"].items()),
        "TTFT ms p50/p99: {p50:.0f} / {p99:.0f}".format(**result["ttft_ms"])
        if result["ttft_ms"]["p50"] is not None
        else "TTFT: no answered request",
        "leaked pages: " + ", ".join(f"{k} {v:.0f}" for k, v in result["leaked_pages"].items()),
        "RSS MiB (first / last / max): "
        + "; ".join(
            f"{k} {v['first']} / {v['last']} / {v['max']}" for k, v in result["rss_mib"].items()
        ),
    ]
    for event in result["fault_events"]:
        lines.append(
            f"  t={event['t']:>6} s  {event['fault']} {'begins' if event['begin'] else 'ends'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--fault", action="append", type=Fault.parse, help="KIND@SECONDS:DURATION")
    p.add_argument("--no-faults", action="store_true", help="load only")
    p.add_argument("--output", help="write the report JSON here")
    p.add_argument("--disconnect-fraction", type=float, default=0.25)
    p.add_argument("--disconnect-within", type=float, default=3.0, help="seconds")
    a = p.parse_args(argv)
    faults = [] if a.no_faults else a.fault
    result = run_soak(
        SoakConfig(
            users=a.users,
            seconds=a.minutes * 60,
            faults=faults,
            model=a.model,
            disconnect_fraction=a.disconnect_fraction,
            disconnect_within_s=a.disconnect_within,
        )
    )
    print(format_report(result))
    if a.output:
        Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["hung"] == 0 and not any(result["leaked_pages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
