"""The router's CPU per streamed token: one router (or two, to compare), a few simulated workers,
and N concurrent streaming chat requests from a lean asyncio client in a process of its own.

    python -m loadtest.router_cpu --concurrency 128 --output-len 128 --seconds 20 \\
        --baseline main --rounds 2 --output bench/results/cpu-router-stream.json

Workers run `--simulate PROFILE` (loadtest/cluster.py's flags: the real services, no model
compute). With `--baseline REF` a second router runs from `git archive REF` (its own copy of the
code, the same workers), and the load alternates between the routers for --rounds rounds of
--seconds each (A, B, A, B, ...), so both meet the same machine. Each phase reports the router
process's CPU seconds (utime + stime from /proc/PID/stat) over the tokens streamed to the client
in it, tokens/s, and the client's TTFT and inter-chunk gaps. `--profile-out PATH` runs the
candidate router under cProfile (CPU seconds, its phases only) and writes its stats there; the
JSON then has each layer's share of that CPU (uvicorn + h11, asyncio, gRPC, the router, ...).

The client is raw asyncio (one HTTP/1.1 connection per stream, `Connection: close`), counting
content chunks by their `"delta":{"content":` and taking the token count from the last chunk's
usage, so its own cost stays small beside the router's on a machine with few cores.

Added latency: the client cannot see when a worker sent a token, so the gaps are reported next
to the simulated decode step the cost model predicts for the phase's batch (`step_ms`): a gap
above it is the router's queueing (or the client's, or the worker's scheduling) delay.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsaserve.engine.ports import free_port
from dsaserve.engine.simulate import CostModel
from loadtest.bench_serving import describe
from loadtest.cluster import Cluster, ClusterConfig
from loadtest.prompts import make_prompt
from loadtest.soak import Process

CONTENT = b'"delta":{"content":'  # a content chunk of a chat stream (the opening has "role")
USAGE = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(frozen=True)
class RouterBenchConfig:
    concurrency: int = 128  # streams open at once (closed loop: each starts the next when done)
    output_len: int = 128
    prompt_words: int = 40
    seconds: float = 20.0  # per phase
    rounds: int = 1  # phases per router
    prefill: int = 1
    decode: int = 2
    profile: str = "bench/results/h200-engine-256.json"
    baseline: str | None = None  # a git ref: a second router runs that code
    stream_interval: int = 1  # the decode workers' --stream-interval (tokens per message)
    seed: int = 0


# ---------------------------------------------------------------- the client (its own process)


async def _one_stream(host: str, port: int, request: bytes) -> dict[str, Any]:
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    arrivals: list[float] = []  # one per content chunk, when the read that completed it came
    tail, body = b"", bytearray()
    try:
        while data := await reader.read(1 << 16):
            now = time.perf_counter()
            body += data
            window = tail + data
            arrivals += [now] * window.count(CONTENT)
            tail = window[-(len(CONTENT) - 1) :]  # a marker cut in two is counted once, here
    finally:
        writer.close()
    done = b"data: [DONE]" in body[-64:]
    usage = USAGE.findall(bytes(body[-1024:]))
    ok = done and body.startswith(b"HTTP/1.1 200") and bool(usage)
    return {
        "ok": ok,
        "tokens": int(usage[-1]) if ok else 0,
        "chunks": len(arrivals),
        "ttft": arrivals[0] - start if arrivals else None,
        "gaps": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "error": None if ok else bytes(body[:200]).decode(errors="replace"),
    }


async def _client(url: str, concurrency: int, seconds: float, bodies: list[bytes]) -> dict:
    host, port = url.removeprefix("http://").split(":")
    requests = [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), len(b), b)
        for b in bodies
    ]
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    stop = start + seconds

    async def user(i: int) -> None:
        k = i
        while time.perf_counter() < stop:
            results.append(await _one_stream(host, int(port), requests[k % len(requests)]))
            k += concurrency

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"][:80]] = errors.get(r["error"][:80], 0) + 1
    return {
        "elapsed_s": elapsed,
        "streams": len(results),
        "ok": len(ok),
        "errors": errors,
        "tokens": sum(r["tokens"] for r in ok),
        "chunks": sum(r["chunks"] for r in ok),
        "ttft_ms": describe([r["ttft"] for r in ok if r["ttft"] is not None], (50, 99)),
        "gap_ms": describe([g for r in ok for g in r["gaps"]], (50, 90, 99)),
    }


def client_main(argv: Sequence[str]) -> int:
    """`--client URL CONCURRENCY SECONDS BODIES.json`: the load, its JSON on stdout."""
    url, concurrency, seconds, bodies_path = argv
    bodies = [json.dumps(b).encode() for b in json.loads(Path(bodies_path).read_text())]
    result = asyncio.run(_client(url, int(concurrency), float(seconds), bodies))
    result["client_cpu_s"] = sum(os.times()[:2])
    print(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the bench


def _cpu_s(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (the event loop's thread is the process's own name, gRPC's
    poller and timer threads have theirs), summed over threads of one name."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + _cpu_s(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _export(ref: str, into: Path) -> Path:
    """The tracked files of `ref`, as they are there."""
    archive = subprocess.run(["git", "archive", ref], check=True, capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into / "src", filter="data")
    return into / "src"


def _wait_up(url: str, workers: dict[str, int], timeout_s: float = 300.0) -> None:
    """Until the router at `url` answers and sees `workers` (live ones by role)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if Cluster._live(url) == workers:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up within {timeout_s:.0f} s")
        time.sleep(0.5)


def _bodies(cfg: RouterBenchConfig, model: str) -> list[dict[str, Any]]:
    rng = random.Random(cfg.seed)
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": make_prompt(cfg.prompt_words, rng)}],
            "max_tokens": cfg.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(4 * cfg.concurrency)
    ]


def _phase(cfg: RouterBenchConfig, router: Process, url: str, bodies: Path) -> dict[str, Any]:
    assert router.popen is not None
    pid = router.popen.pid
    argv = [sys.executable, "-m", "loadtest.router_cpu", "--client", url]
    argv += [str(cfg.concurrency), str(cfg.seconds), str(bodies)]
    stat = Path(f"/proc/{pid}/stat")
    cpu0, threads0 = _cpu_s(stat), _threads_cpu_s(pid)
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    cpu, threads = _cpu_s(stat) - cpu0, _threads_cpu_s(pid)
    result = json.loads(out)
    tokens = result["tokens"]
    result["router_cpu_s"] = cpu
    result["router_threads_cpu_s"] = {
        name: round(t - threads0.get(name, 0.0), 2) for name, t in threads.items()
    }
    result["router_cpu_us_per_token"] = 1e6 * cpu / tokens if tokens else None
    result["tokens_per_s"] = tokens / result["elapsed_s"]
    # what one core of this router streams at that cost
    result["tokens_per_core_s"] = tokens / cpu if cpu else None
    return result


def _step_ms(cfg: RouterBenchConfig) -> float:
    """The simulated decode step at the phase's batch per decode worker, mid-answer."""
    cost = CostModel.from_profile(cfg.profile)
    rows = max(1, min(64, cfg.concurrency // cfg.decode))
    context = int(cfg.prompt_words * 1.5) + cfg.output_len // 2  # ~1.5 tokens a word
    return 1e3 * cost.step_s(0, [context] * rows)


def run(cfg: RouterBenchConfig, profile_out: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dsaserve-router-cpu-"))
    cluster_cfg = ClusterConfig(
        prefill=cfg.prefill,
        decode=cfg.decode,
        routers=1,
        profile=cfg.profile,
        policy="least_load",
        stream_interval=cfg.stream_interval,
    )
    cluster = Cluster(cluster_cfg, work)
    candidate = cluster.routers[0]
    routers = {"candidate": (candidate, cluster.router_urls[0])}
    if cfg.baseline is not None:
        port = free_port()
        argv = [*candidate.argv]
        argv[argv.index("--port") + 1] = str(port)
        baseline = Process("router-baseline", argv, cwd=str(_export(cfg.baseline, work)))
        routers["baseline"] = (baseline, f"http://127.0.0.1:{port}")
    if profile_out is not None:  # `python -m loadtest.router_cpu --profiled PATH router ...`
        at = candidate.argv.index("-m")
        candidate.argv[at:] = [
            "-m", "loadtest.router_cpu", "--profiled", str(Path(profile_out).resolve()),
            *candidate.argv[at + 2 :],
        ]  # fmt: skip
    try:
        cluster.start()
        if "baseline" in routers:
            routers["baseline"][0].start(work)
            _wait_up(routers["baseline"][1], {"prefill": cfg.prefill, "decode": cfg.decode})
        with urllib.request.urlopen(cluster.router_urls[0] + "/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        bodies = work / "bodies.json"
        bodies.write_text(json.dumps(_bodies(cfg, model)))
        phases: list[dict[str, Any]] = []
        if profile_out is not None:
            candidate.signal(signal.SIGUSR1)  # from here on
        for r in range(cfg.rounds):
            for name, (router, url) in routers.items():
                result = _phase(cfg, router, url, bodies)
                phases.append({"router": name, "round": r, **result})
                print(_line(phases[-1]), flush=True)
    finally:
        if profile_out is not None and candidate.popen is not None:
            # uvicorn re-raises the signal that stopped it: SIGTERM's default action would kill
            # the process before cProfile writes, SIGINT's KeyboardInterrupt lets it write
            candidate.signal(signal.SIGINT)
            candidate.popen.wait(timeout=60)
        for router, _ in list(routers.values())[1:]:
            router.stop()
        cluster.stop()
    result = _summary(cfg, phases)
    if profile_out is not None:
        result["profile"] = {"path": profile_out, "cpu_share": profile_breakdown(profile_out)}
    return result


def _summary(cfg: RouterBenchConfig, phases: list[dict[str, Any]]) -> dict[str, Any]:
    per_router = {}
    for name in dict.fromkeys(p["router"] for p in phases):
        mine = [p for p in phases if p["router"] == name]
        cpu, tokens = sum(p["router_cpu_s"] for p in mine), sum(p["tokens"] for p in mine)
        seconds = sum(p["elapsed_s"] for p in mine)
        per_router[name] = {
            "router_cpu_us_per_token": 1e6 * cpu / tokens if tokens else None,
            "tokens_per_s": tokens / seconds,
            "tokens_per_core_s": tokens / cpu if cpu else None,
            "router_cpu_share": cpu / seconds,  # cores the router kept busy
        }
    out: dict[str, Any] = {"config": asdict(cfg), "step_ms": _step_ms(cfg), "phases": phases}
    out["routers"] = per_router
    if "baseline" in per_router:
        a = per_router["baseline"]["router_cpu_us_per_token"]
        b = per_router["candidate"]["router_cpu_us_per_token"]
        out["baseline_over_candidate"] = a / b if a and b else None
    return out


def _line(p: dict[str, Any]) -> str:
    ms = lambda d, k: f"{d[k]:.1f}" if d.get(k) is not None else "-"
    return (
        f"{p['router']:9} round {p['round']}: {p['ok']}/{p['streams']} streams, "
        f"{p['tokens']} tokens, {p['tokens_per_s']:.0f} tok/s, router CPU "
        f"{p['router_cpu_us_per_token'] or 0:.0f} us/token ({p['tokens_per_core_s'] or 0:.0f} "
        f"tok/s per core), TTFT p50/p99 {ms(p['ttft_ms'], 'p50')}/{ms(p['ttft_ms'], 'p99')} ms, "
        f"gap p50/p99 {ms(p['gap_ms'], 'p50')}/{ms(p['gap_ms'], 'p99')} ms, client CPU "
        f"{p['client_cpu_s']:.1f} s\n    router threads' CPU s: {p['router_threads_cpu_s']}"
    )


def profiled_main(argv: Sequence[str]) -> int:
    """`--profiled PATH ARGS...`: `dsaserve ARGS...`, profiled by cProfile from SIGUSR1 on (so
    startup stays out), timed in CPU seconds (the process's: waiting in epoll counts nothing);
    the stats are written to PATH at exit. The event loop's thread is the one profiled."""
    from dsaserve.services import cli

    profile = cProfile.Profile(time.process_time)
    signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
    try:
        cli.main(list(argv[1:]))
    except KeyboardInterrupt:
        pass
    finally:
        profile.disable()
        profile.dump_stats(argv[0])
    return 0


# Where the profiled router's CPU goes, by the file a function is in (first match wins).
LAYERS = (
    ("grpc", ("/grpc/",)),
    (
        "asyncio event loop",
        ("/asyncio/", "selectors.py", "select.epoll", "_contextvars", "_asyncio"),
    ),
    ("uvicorn + h11 (HTTP framing)", ("/uvicorn/", "/h11/")),
    ("starlette + fastapi + anyio", ("/starlette/", "/fastapi/", "/anyio/")),
    ("socket writes", ("_socket.socket",)),
    ("json", ("/json/",)),
    ("prometheus_client", ("/prometheus_client/",)),
    ("router (services/router)", ("dsaserve/services/router/",)),
    ("reply parser (engine/text)", ("dsaserve/engine/text/",)),
)


def profile_breakdown(path: str) -> dict[str, float]:
    """Each layer's share of the profiled CPU seconds (own time of its functions)."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    seconds: dict[str, float] = {}
    for (filename, _, name), (_, _, own, _, _) in stats.items():
        where = f"{filename}:{name}"
        layer = next((k for k, keys in LAYERS if any(x in where for x in keys)), "other")
        seconds[layer] = seconds.get(layer, 0.0) + own
    total = sum(seconds.values())
    return {k: round(v / total, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:
        return client_main(argv[1:])
    if argv[:1] == ["--profiled"]:
        return profiled_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(RouterBenchConfig()).items():
        kind = type(default) if default is not None else str
        parser.add_argument("--" + f.replace("_", "-"), dest=f, type=kind, default=default)
    parser.add_argument("--output", default=None)
    parser.add_argument("--profile-out", default=None, help="cProfile stats of the candidate")
    args = vars(parser.parse_args(argv))
    output, profile_out = args.pop("output"), args.pop("profile_out")
    cfg = replace(RouterBenchConfig(), **args)
    result = run(cfg, profile_out)
    print(f"simulated decode step at this batch: {result['step_ms']:.1f} ms")
    if "profile" in result:
        print("profiled router's CPU by layer:", result["profile"]["cpu_share"])
    for name, r in result["routers"].items():
        print(f"{name}: {r['router_cpu_us_per_token']:.0f} us/token, {r['tokens_per_s']:.0f} tok/s")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(p["ok"] == p["streams"] for p in result["phases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
