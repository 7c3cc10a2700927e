"""A simulated cluster on one CPU: N prefill and M decode workers (`--simulate PROFILE`: the real
services, pages, leases, prefix caches and KV pulls, steps timed by a cost model, no model
compute), R routers, a real redis-server, and a trace of chat streams spread over the routers.

    python -m loadtest.cluster --prefill 16 --decode 16 --routers 2 --rate 40 --duration 60 \\
        --max-concurrency 1000 --output bench/results/cpu-cluster-16x16.json
    python -m loadtest.cluster --trace mooncake.jsonl ...     # a Mooncake-format trace

The synthetic trace is multi-tenant and multi-turn: --tenants system prompts, conversations
arriving as a Poisson process (--rate per second), each --turns requests long (the next turn
appends the answer and a new question), tenant chosen uniformly. A Mooncake trace (JSON lines of
`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one id per 512-token block, shared
ids = shared prefix, as aiperf replays them) becomes prompts whose blocks are words drawn from
each hash id, so equal ids make equal text.

Reported: goodput (requests within --slo-ttft-ms and --slo-itl-ms, and their output tokens/s),
TTFT / ITL / E2E percentiles, requests per prefill and decode worker (busiest over mean), the
prefix cache's hit rate (cached prompt tokens over prompt tokens, from the answers' usage)
against the trace's best possible (each prompt's longest start shared with any earlier one, in
16-token blocks, through one infinite cache), every router's CPU seconds per streamed token and
tokens/s, and at the end whether every worker's pages came back and no stream hung.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.ports import free_port
from loadtest.bench_serving import describe
from loadtest.openai_stream import StreamRecord, chat_payload
from loadtest.prompts import make_prompt
from loadtest.soak import Process

BLOCK = 16  # tokens per block of the best-possible hit rate
MOONCAKE_BLOCK = 512  # tokens per hash id in a Mooncake trace
# a simulated worker's pools: small, so 32 fit a CPU machine's memory (bf16: nothing computes),
# a prefill worker's with room for ~150 checkpoints of the demo model's prefix cache
WORKER_FLAGS = [
    "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(192 << 20), "--max-num-seqs", "64",
    "--max-num-batched-tokens", "2048",
]  # fmt: skip
PREFILL_FLAGS = ["--prefix-cache-checkpoint-memory-bytes", str(96 << 20)]


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 4
    decode: int = 4
    routers: int = 2
    profile: str = "bench/results/h200-engine-256.json"
    model: str | None = None
    policy: str = "cache_aware"
    trace: str | None = None  # a Mooncake JSONL; None: the synthetic trace
    rate: float = 20.0  # conversations per second (synthetic)
    duration_s: float = 10.0  # arrivals stop after this (synthetic)
    tenants: int = 8
    system_words: int = 150
    question_words: int = 15
    turns: int = 3
    output_len: int = 32
    max_concurrency: int = 1000
    stream_interval: int = 1  # the decode workers' --stream-interval (tokens per message)
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 200.0
    timeout_s: float = 120.0
    seed: int = 0


@dataclass
class Turn:
    at_s: float  # arrival after the start (its conversation's; later turns follow answers)
    tenant: int
    questions: list[str]  # one per turn
    output_len: int
    system: str


def synthetic_trace(cfg: ClusterConfig, rng: random.Random) -> list[Turn]:
    systems = [make_prompt(cfg.system_words, rng) for _ in range(cfg.tenants)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(cfg.rate)
        if t > cfg.duration_s:
            return out
        tenant = rng.randrange(cfg.tenants)
        questions = [make_prompt(cfg.question_words, rng) for _ in range(cfg.turns)]
        out.append(Turn(t, tenant, questions, cfg.output_len, systems[tenant]))


def mooncake_trace(path: str) -> list[Turn]:
    """Each line one request; a block of text per hash id (4 words a token is ample: the
    request's length is its blocks', cut to input_length words)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        words = []
        for block in r.get("hash_ids", []):
            block_rng = random.Random(f"mooncake-{block}")
            words.append(make_prompt(MOONCAKE_BLOCK // 4, block_rng))
        text = " ".join(words).split()[: max(1, int(r["input_length"]) // 4)]
        out.append(Turn(r["timestamp"] / 1e3, 0, [" ".join(text)], int(r["output_length"]), ""))
    return out


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamRecord:
    """One streamed chat request. A connection error before the response's head (the router
    closing a kept-alive connection as the client reuses it, a race on a starved machine) is
    retried once on a fresh connection, as the OpenAI SDK retries connection errors; the
    record counts it (`retries`) and the report sums them."""
    record = StreamRecord(start=time.perf_counter())
    for attempt in range(2):
        answered = False  # the response's head came: an error after it broke a stream under way
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        record.feed(line, time.perf_counter())
        except httpx.TransportError as e:
            if not answered and attempt == 0:
                record.retries += 1
                continue
            where = "mid-stream" if answered else "before the response"
            record.error = f"{type(e).__name__} {where}: {e}"
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
        break
    record.finish(time.perf_counter())
    return record


class Cluster:
    def __init__(self, cfg: ClusterConfig, log_dir: Path) -> None:
        self.log_dir = log_dir
        redis_port = free_port()
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        cli = [sys.executable, "-m", "dsaserve.services.cli"]
        common = ["--redis-url", redis_url, "--model", cfg.model or str(DEMO_MODEL_DIR)]
        redis = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"]  # fmt: skip
        self.redis = Process("redis", redis)
        self.workers = []
        for role, n in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for i in range(n):
                metrics = free_port()
                argv = cli + [role, *common, "--port", "0", "--metrics-port", str(metrics),
                              "--worker-id", f"{role}-{i}", "--simulate", cfg.profile,
                              *WORKER_FLAGS]  # fmt: skip
                if role == "prefill":
                    argv += PREFILL_FLAGS
                else:
                    argv += ["--stream-interval", str(cfg.stream_interval)]
                self.workers.append(Process(f"{role}-{i}", argv, metrics))
        self.router_urls, self.routers = [], []
        for i in range(cfg.routers):
            port = free_port()
            argv = cli + ["router", *common, "--port", str(port), "--policy", cfg.policy]
            self.routers.append(Process(f"router-{i}", argv))
            self.router_urls.append(f"http://127.0.0.1:{port}")

    @property
    def processes(self) -> list[Process]:
        return [self.redis, *self.workers, *self.routers]

    def start(self, timeout_s: float = 600.0) -> None:
        for p in self.processes:
            p.start(self.log_dir)
        deadline = time.monotonic() + timeout_s
        while not all(self._ready(w) for w in self.workers) or not all(
            _status(u + "/health") == 200 for u in self.router_urls
        ):
            for p in self.processes:
                if p.popen is not None and p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited; see {self.log_dir / p.name}.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not up within {timeout_s:.0f} s")
            time.sleep(0.5)
        # every router must see every worker before the load starts
        want = {"prefill": len([w for w in self.workers if w.name.startswith("prefill")])}
        want["decode"] = len(self.workers) - want["prefill"]
        while any(self._live(u) != want for u in self.router_urls):
            if time.monotonic() > deadline:
                raise RuntimeError("the routers do not see every worker")
            time.sleep(0.5)

    @staticmethod
    def _ready(worker: Process) -> bool:
        return _status(f"http://127.0.0.1:{worker.metrics_port}/ready") == 200

    @staticmethod
    def _live(url: str) -> dict[str, int]:
        samples = _metric(url + "/metrics", "dsaserve_router_live_workers")
        return {labels["role"]: int(v) for labels, v in samples}

    def worker_counts(self) -> dict[str, float]:
        out = {}
        for w in self.workers:
            role = w.name.split("-")[0]
            samples = _metric(self.metrics_url(w), "dsaserve_worker_requests_total")
            out[w.name] = sum(
                v for labels, v in samples if labels == {"role": role, "outcome": "ok"}
            )
        return out

    def pages_back(self) -> bool:
        for w in self.workers:
            gauge = {
                n: sum(v for _, v in _metric(self.metrics_url(w), n))
                for n in (
                    "dsaserve_kv_pages_free",
                    "dsaserve_kv_pages_cached",
                    "dsaserve_kv_pages_total",
                    "dsaserve_requests_running",
                    "dsaserve_requests_waiting",
                    "dsaserve_requests_held",
                )
            }
            free = gauge["dsaserve_kv_pages_free"] + gauge["dsaserve_kv_pages_cached"]
            busy = sum(gauge[f"dsaserve_requests_{k}"] for k in ("running", "waiting", "held"))
            if free != gauge["dsaserve_kv_pages_total"] or busy:
                return False
        return True

    @staticmethod
    def metrics_url(w: Process) -> str:
        return f"http://127.0.0.1:{w.metrics_port}/metrics"

    def router_cpu_s(self) -> list[float]:
        tick = os.sysconf("SC_CLK_TCK")
        out = []
        for r in self.routers:
            assert r.popen is not None
            fields = Path(f"/proc/{r.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)  # utime + stime
        return out

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except OSError:
        return None


def _metric(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` in a Prometheus text page."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[line.find("{") + 1 : line.find("}")] if "{" in line else ""
            pairs = (p.split("=", 1) for p in labels.split(",") if "=" in p)
            out.append(({k: v.strip('"') for k, v in pairs}, float(line.split()[-1])))
    return out


async def run_load(cfg: ClusterConfig, cluster: Cluster, turns: list[Turn]) -> dict[str, Any]:
    """Replay the trace over the routers (request i to router i mod R)."""
    gate = asyncio.Semaphore(cfg.max_concurrency)
    # keep-alive shorter than uvicorn's 5 s: a request never goes out on a connection the
    # router is closing (the race is a ReadError, not the router's fault)
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency + 8, max_keepalive_connections=None, keepalive_expiry=2
    )
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    records: list[tuple[StreamRecord, list[dict[str, str]]]] = []
    counter = iter(range(1 << 62))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = (await client.get(cluster.router_urls[0] + "/v1/models")).json()["data"][0]["id"]

        async def converse(turn: Turn) -> None:
            messages = [{"role": "system", "content": turn.system}] if turn.system else []
            for question in turn.questions:
                messages = [*messages, {"role": "user", "content": question}]
                url = cluster.router_urls[next(counter) % len(cluster.router_urls)]
                async with gate:
                    record = await stream(
                        client, url, chat_payload(model, messages, turn.output_len)
                    )
                records.append((record, messages))
                if not record.ok:
                    return
                messages = [*messages, {"role": "assistant", "content": "".join(record.text)}]

        cpu0, start = cluster.router_cpu_s(), time.perf_counter()
        tasks = []
        for turn in turns:
            await asyncio.sleep(max(0.0, turn.at_s - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(converse(turn)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = [b - a for a, b in zip(cpu0, cluster.router_cpu_s(), strict=True)]
        best = await best_hit_rate(client, cluster.router_urls[0], model, records)
    return summarize(cfg, cluster, records, duration, cpu, best)


async def best_hit_rate(
    client: httpx.AsyncClient, url: str, model: str, records: list[tuple[StreamRecord, list]]
) -> float:
    """Prompt tokens an infinite cache shared by all would resume (16-token blocks of each
    prompt's longest start seen before, in send order), over all prompt tokens."""
    seen: set[bytes] = set()
    hit = total = 0
    for _, messages in sorted(records, key=lambda rm: rm[0].start):
        body = {"model": model, "messages": messages}
        ids = (await client.post(url + "/tokenize", json=body)).json()["tokens"]
        digest, shared = hashlib.sha1(), 0
        for b in range(len(ids) // BLOCK):
            digest.update(json.dumps(ids[b * BLOCK : (b + 1) * BLOCK]).encode())
            key = digest.copy().digest()
            if key in seen and shared == b * BLOCK:
                shared = (b + 1) * BLOCK
            seen.add(key)
        hit += min(shared, len(ids) - 1)
        total += len(ids)
    return hit / total if total else 0.0


def summarize(
    cfg: ClusterConfig,
    cluster: Cluster,
    records: list[tuple[StreamRecord, list]],
    duration: float,
    router_cpu: list[float],
    best: float,
) -> dict[str, Any]:
    ok = [r for r, _ in records if r.ok]
    slo = [
        r
        for r in ok
        if r.ttft is not None
        and r.ttft * 1e3 <= cfg.slo_ttft_ms
        and all(g * 1e3 <= cfg.slo_itl_ms for g in r.itl)
    ]
    tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    counts = cluster.worker_counts()
    spread = {}
    for role in ("prefill", "decode"):
        values = [v for k, v in counts.items() if k.startswith(role)]
        mean = sum(values) / len(values) if values else 0
        spread[role] = {"busiest_over_mean": max(values) / mean if mean else None}
    errors: dict[str, int] = {}
    for r, _ in records:
        if r.error:
            kind = r.error[:120]
            errors[kind] = errors.get(kind, 0) + 1
    hit = cached / prompt if prompt else 0.0
    return {
        "config": asdict(cfg),
        "duration_s": duration,
        "requests": len(records),
        "ok": len(ok),
        "streams_in_flight": in_flight([r for r, _ in records], duration),
        "errors": errors,
        "retried_before_response": sum(r.retries for r, _ in records),
        "hung": sum(1 for r, _ in records if r.error and "Timeout" in r.error),
        "output_tokens_per_s": tokens / duration,
        "goodput": {
            "requests_per_s": len(slo) / duration,
            "output_tokens_per_s": sum(r.output_tokens for r in slo) / duration,
            "share": len(slo) / len(records) if records else 0.0,
        },
        "ttft_s": describe([r.ttft for r in ok if r.ttft is not None], (50, 90, 99)),
        "itl_s": describe([g for r in ok for g in r.itl], (50, 90, 99)),
        "e2e_s": describe([r.latency for r in ok if r.latency is not None], (50, 90, 99)),
        "requests_per_worker": counts,
        "load_spread": spread,
        "cache": {"hit_rate": hit, "best_possible": best, "of_best": hit / best if best else None},
        "routers": {
            "cpu_s": router_cpu,
            "cpu_us_per_token": [1e6 * c / (tokens / len(router_cpu)) for c in router_cpu]
            if tokens
            else None,
            "tokens_per_s_each": tokens / len(router_cpu) / duration,
        },
    }


def in_flight(records: list[StreamRecord], duration: float) -> dict[str, float]:
    """Streams open at once, from each request's send to its last byte: the mean over the run
    and the peak."""
    spans = [(r.start, r.start + r.latency) for r in records if r.latency is not None]
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    mean = sum(b - a for a, b in spans) / duration if duration else 0.0
    return {"mean": mean, "peak": peak}


def run_cluster(cfg: ClusterConfig, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the cluster, replay the trace, wait for every page to come back, stop."""
    rng = random.Random(cfg.seed)
    turns = mooncake_trace(cfg.trace) if cfg.trace else synthetic_trace(cfg, rng)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="dsaserve-cluster-"))
    cluster = Cluster(cfg, log_dir)
    try:
        cluster.start()
        result = asyncio.run(run_load(cfg, cluster, turns))
        deadline = time.monotonic() + 60
        while not (back := cluster.pages_back()) and time.monotonic() < deadline:
            time.sleep(0.5)
        result["pages_back"] = back
        return result
    finally:
        cluster.stop()


def format_report(result: dict[str, Any]) -> str:
    c, q = result["config"], result
    pct = lambda d, k: f"{d[k]:.1f}" if d.get(k) is not None else "-"  # (ms)
    lines = [
        f"cluster: {c['prefill']} prefill + {c['decode']} decode (simulated), {c['routers']} "
        f"routers, policy {c['policy']}",
        f"requests {q['requests']} ok {q['ok']} errors {q['errors']} hung {q['hung']} "
        f"(retried before the response: {q.get('retried_before_response', 0)}) "
        f"pages back {q.get('pages_back')}; streams in flight: mean "
        f"{q['streams_in_flight']['mean']:.0f}, peak {q['streams_in_flight']['peak']}",
        f"output tokens/s {q['output_tokens_per_s']:.0f}; goodput "
        f"{q['goodput']['output_tokens_per_s']:.0f} tok/s ({100 * q['goodput']['share']:.0f}% "
        "of requests within the SLOs)",
        f"TTFT ms p50/p90/p99 {pct(q['ttft_s'], 'p50')}/{pct(q['ttft_s'], 'p90')}/"
        f"{pct(q['ttft_s'], 'p99')}; ITL ms {pct(q['itl_s'], 'p50')}/{pct(q['itl_s'], 'p90')}/"
        f"{pct(q['itl_s'], 'p99')}",
        f"busiest/mean requests: prefill {q['load_spread']['prefill']['busiest_over_mean']}, "
        f"decode {q['load_spread']['decode']['busiest_over_mean']}",
        f"cache hit rate {q['cache']['hit_rate']:.3f} of best {q['cache']['best_possible']:.3f} "
        f"({q['cache']['of_best']})",
        f"router CPU us/token {q['routers']['cpu_us_per_token']}, tokens/s each "
        f"{q['routers']['tokens_per_s_each']:.0f}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(ClusterConfig()).items():
        flag = "--" + f.removesuffix("_s").replace("_", "-")
        kind = type(default) if default is not None else str
        parser.add_argument(flag, dest=f, type=kind, default=default)
    parser.add_argument("--output", default=None)
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    result = run_cluster(ClusterConfig(**args))
    print(format_report(result))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] == result["requests"] and result["pages_back"] else 1


if __name__ == "__main__":
    sys.exit(main())
