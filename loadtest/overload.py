"""Overload: the CPU demo stack at N times its capacity for a while, then the accounting.

    python -m loadtest.overload --factor 4 --seconds 120 --output bench/results/overload-cpu.json

Starts its own stack (soak.LocalStack: redis-server, one prefill and one decode worker, the
router; the built-in model), measures its capacity with a closed loop of --capacity-users
streaming users, then sends Poisson arrivals at --factor times that rate for --seconds. Each
client gives up after --client-timeout seconds and hangs up, as real clients do. Every request
must end in one of: answered (200, a complete stream), refused early (429 or 503 with a
Retry-After header), or an error; "hung" counts the ones still unanswered when their client
gave up. Goodput is answered requests per second, against the capacity. After the load the
stack must return to idle: the router's in-flight requests at 0, every KV page free; then the
capacity is measured again, and goodput is judged against the mean of the two (on a shared
machine the other work's load moves the capacity by 2x within minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from loadtest.openai_stream import chat_payload
from loadtest.prompts import make_prompt
from loadtest.soak import LocalStack

ENGINE_FLAGS = ("--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "32")
# Admission sized to the stack: a few batches' worth in flight, a queue wait well inside the
# clients' patience; the rest is refused at once (429) or after the wait (503).
ROUTER_FLAGS = ("--max-inflight", "4", "--max-queue", "16", "--max-queue-delay", "5")


@dataclass
class Outcome:
    kind: str  # ok | refused | refused_without_retry_after | error | hung
    seconds: float  # until the answer, the refusal, or the client gave up
    status: int | None = None


async def one_request(
    client: httpx.AsyncClient, model: str, rng: random.Random, timeout_s: float, words: int
) -> Outcome:
    body = chat_payload(model, make_prompt(words, rng), 16)
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code in (429, 503):
                    kind = (
                        "refused" if "retry-after" in r.headers else "refused_without_retry_after"
                    )
                    return Outcome(kind, time.monotonic() - start, r.status_code)
                if r.status_code != 200:
                    return Outcome("error", time.monotonic() - start, r.status_code)
                done = False
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):
                        return Outcome("error", time.monotonic() - start, 200)
                    done = done or line == "data: [DONE]"
                kind = "ok" if done else "error"
                return Outcome(kind, time.monotonic() - start, 200)
    except TimeoutError:  # the client gives up and hangs up
        return Outcome("hung", time.monotonic() - start)
    except httpx.HTTPError:
        return Outcome("error", time.monotonic() - start)


async def capacity(url: str, model: str, users: int, seconds: float, words: int) -> float:
    """Answered requests per second of a closed loop of `users` users."""
    rng, answered = random.Random(1), 0
    end = time.monotonic() + seconds

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal answered
        while time.monotonic() < end:
            if (await one_request(client, model, rng, 120.0, words)).kind == "ok":
                answered += 1

    limits = httpx.Limits(max_connections=users * 2)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(user(client) for _ in range(users)))
        return answered / (time.monotonic() - start)


async def overload(
    url: str, model: str, rate: float, seconds: float, timeout_s: float, words: int
) -> tuple[list[Outcome], float]:
    """Poisson arrivals at `rate` for `seconds`: every request's outcome, and the span until the
    last one ended."""
    rng = random.Random(2)
    tasks = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.monotonic()
        end = start + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(one_request(client, model, rng, timeout_s, words)))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
        return list(outcomes), time.monotonic() - start


def router_inflight(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("dsaserve_router_inflight_requests ")
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factor", type=float, default=4.0, help="times the measured capacity")
    p.add_argument("--seconds", type=float, default=120.0, help="how long the overload lasts")
    p.add_argument("--capacity-users", type=int, default=8)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--client-timeout", type=float, default=30.0)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output", help="write the report JSON here")
    a = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="dsaserve-overload-"))
    stack = LocalStack(str(DEMO_MODEL_DIR), log_dir, ENGINE_FLAGS, lease_s=8.0)
    stack.procs["router"].argv += ROUTER_FLAGS
    stack.start()
    try:
        with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        cap = asyncio.run(
            capacity(stack.url, model, a.capacity_users, a.capacity_seconds, a.prompt_words)
        )
        rate = a.factor * cap
        outcomes, span = asyncio.run(
            overload(stack.url, model, rate, a.seconds, a.client_timeout, a.prompt_words)
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the stack returns to idle
            pages = {role: stack.worker_pages(role) for role in ("prefill", "decode")}
            idle = router_inflight(stack.url) == 0 and all(
                p["free"] + p.get("cached", 0) == p["total"] and not p["held"]
                for p in pages.values()
            )
            if idle:
                break
            time.sleep(0.5)
        inflight_after = router_inflight(stack.url)
        cap_after = asyncio.run(
            capacity(stack.url, model, a.capacity_users, a.capacity_seconds, a.prompt_words)
        )
        cap_mean = (cap + cap_after) / 2
        kinds = Counter(o.kind for o in outcomes)
        refusals = [o.seconds for o in outcomes if o.kind.startswith("refused")]
        answered = [o.seconds for o in outcomes if o.kind == "ok"]
        report: dict[str, Any] = {
            "factor": a.factor,
            "seconds": a.seconds,
            "client_timeout_s": a.client_timeout,
            "prompt_words": a.prompt_words,
            "engine_flags": list(ENGINE_FLAGS),
            "router_flags": list(ROUTER_FLAGS),
            "capacity_rps": round(cap, 3),
            "capacity_after_rps": round(cap_after, 3),
            "offered_rps": round(rate, 3),
            "requests": len(outcomes),
            "outcomes": dict(kinds),
            "statuses": dict(Counter(str(o.status) for o in outcomes)),
            "goodput_rps": round(kinds["ok"] / span, 3),
            "goodput_vs_capacity": round(kinds["ok"] / span / cap_mean, 3) if cap_mean else None,
            "answered_p50_s": percentile(answered, 50),
            "answered_p99_s": percentile(answered, 99),
            "refused_p50_s": percentile(refusals, 50),
            "refused_p99_s": percentile(refusals, 99),
            "idle_after": idle,
            "pages_after": pages,
            "router_inflight_after": inflight_after,
        }
    finally:
        stack.stop()
    rows = [(k, v) for k, v in report.items() if not isinstance(v, dict | list)]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"outcomes  {report['outcomes']}\nstatuses  {report['statuses']}")
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
