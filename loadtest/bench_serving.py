"""Serving benchmark for an OpenAI-compatible endpoint, in the manner of `vllm bench serve`.

    python loadtest/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --request-rate 4 --input-len 512 --output-len 128 --output results/disagg-rate4.json

Requests arrive all at once (`--request-rate inf`) or as a Poisson process at the given rate,
optionally capped at `--max-concurrency` in flight. Every request streams, and the client times
each token itself. Definitions follow vLLM/SGLang, so the numbers compare with theirs:
  TTFT  request sent -> first content chunk
  ITL   every gap between consecutive content chunks, pooled over all requests
  TPOT  per request, (E2E - TTFT) / (output tokens - 1)
  E2E   request sent -> `data: [DONE]`
Only successful requests count towards latencies and token throughput.

`run_benchmark(BenchConfig(...)) -> dict` is the same run for Python callers (tests, notebooks).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

try:
    from loadtest.openai_stream import StreamRecord, auth_headers, chat_payload
    from loadtest.prompts import PROBE_WORDS, calibrated_words, load_tokenizer, make_prompt
except ImportError:  # run as `python loadtest/bench_serving.py`: this folder is on sys.path
    from openai_stream import StreamRecord, auth_headers, chat_payload  # type: ignore[no-redef]
    from prompts import (  # type: ignore[no-redef]
        PROBE_WORDS,
        calibrated_words,
        load_tokenizer,
        make_prompt,
    )


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id from GET /v1/models
    num_prompts: int = 100
    request_rate: float = math.inf  # requests/s; inf sends everything at t=0
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    # vLLM's --random-range-ratio: each request's prompt and output lengths are drawn uniformly
    # from [len * (1 - ratio), len]; 0 = every request the same.
    range_ratio: float = 0.0
    api_key: str | None = None
    endpoint: str = "/v1/chat/completions"
    ignore_eos: bool = True
    tokenizer: str | None = None  # tokenizer.json or model folder, for exact prompt lengths
    calibrate: bool = True  # without a tokenizer, size prompts from the server's token counts
    seed: int = 0
    timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    label: str | None = None
    save_details: bool = False

    def public(self) -> dict[str, Any]:
        """The config as recorded in results: never the key, and inf as a JSON-safe string."""
        out = dataclasses.asdict(self)
        out.pop("api_key")
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


# --- statistics (pure functions over recorded timings) --------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe(seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/max and the requested percentiles, in milliseconds (None when empty)."""
    keys = ["mean", "median", "std", "max"] + [f"p{p:g}" for p in percentiles]
    if not seconds:
        return dict.fromkeys(keys)
    ms = [s * 1000.0 for s in seconds]
    out: dict[str, float | None] = {
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "std": statistics.pstdev(ms),
        "max": max(ms),
    }
    out.update({f"p{p:g}": percentile(ms, p) for p in percentiles})
    return out


def tpot(record: StreamRecord) -> float | None:
    if record.output_tokens <= 1 or record.ttft is None or record.latency is None:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def summarize(
    records: Sequence[StreamRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    expected_output_len: int | None = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        # Mean number of requests in flight (Little's law over successful requests).
        "concurrency": sum(r.latency or 0.0 for r in ok) / duration_s,
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": describe(tpots, percentiles),
        "itl_ms": describe([gap for r in ok for gap in r.itl], percentiles),
        "e2e_ms": describe([r.latency for r in ok if r.latency is not None], percentiles),
        # With ignore_eos every request should produce exactly output_len tokens.
        "wrong_output_len": None
        if expected_output_len is None
        else sum(r.output_tokens != expected_output_len for r in ok),
        "errors": dict(Counter(_error_kind(r.error) for r in failed).most_common(10)),
    }


def _error_kind(error: str | None) -> str:
    # Group "prompt has 797 tokens" with "prompt has 802 tokens": one cause, not one line per
    # request. The HTTP status in front stays.
    status, rest = re.match(r"(HTTP \d+: )?(.*)", error or "unknown", re.S).groups()
    return (status or "") + re.sub(r"\d+", "N", rest)


def drawn_length(length: int, ratio: float, rng: random.Random) -> int:
    """A length uniform in [length * (1 - ratio), length] (vLLM's random dataset)."""
    return rng.randint(max(1, round(length * (1 - ratio))), length) if ratio else length


def arrival_gaps(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: none at rate inf, else exponential (Poisson)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("request rate must be > 0 (or inf)")
    return [rng.expovariate(rate) for _ in range(n)]


# --- the run --------------------------------------------------------------------------------------


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str, output_len: int
) -> StreamRecord:
    payload = chat_payload(model, prompt, output_len, ignore_eos=cfg.ignore_eos)
    record = StreamRecord(start=time.perf_counter())
    try:
        async with client.stream(
            "POST", cfg.endpoint, json=payload, headers=auth_headers(cfg.api_key)
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {body[:200]}"
            else:
                async for line in resp.aiter_lines():
                    record.feed(line, time.perf_counter())
                    if record.error:
                        break
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.finish(time.perf_counter())
    return record


async def resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    resp = await client.get("/v1/models", headers=auth_headers(cfg.api_key))
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def prompt_words(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, rng: random.Random
) -> int:
    """Words per prompt for `input_len` tokens, measured with two 1-token probe requests.

    Falls back to one word per token (with a warning) if the probes fail. The probes also open
    the first connection, so that cost stays out of the measured run.
    """
    probes = []
    for words in PROBE_WORDS:
        record = await send_request(client, cfg, model, make_prompt(words, rng), 1)
        if not record.ok or record.prompt_tokens is None:
            print(
                f"warning: no prompt calibration ({record.error or 'no usage'}); "
                "--input-len counts words",
                file=sys.stderr,
            )
            return cfg.input_len
        probes.append((words, record.prompt_tokens))
    return calibrated_words(cfg.input_len, probes)


async def arun_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    gaps = arrival_gaps(cfg.num_prompts, cfg.request_rate, rng)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    # httpx pools 100 connections by default, which would silently cap concurrency; proxies from
    # the environment (trust_env) would be measured along with the server.
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency
    )
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        model = await resolve_model(client, cfg)
        words = cfg.input_len
        if tokenizer is None and cfg.calibrate:
            words = await prompt_words(client, cfg, model, rng)
        shapes = [
            (
                make_prompt(drawn_length(words, cfg.range_ratio, rng), rng, tokenizer),
                drawn_length(cfg.output_len, cfg.range_ratio, rng),
            )
            for _ in range(cfg.num_prompts)
        ]

        async def one(prompt: str, output_len: int) -> StreamRecord:
            if gate is None:
                return await send_request(client, cfg, model, prompt, output_len)
            async with gate:
                return await send_request(client, cfg, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for (prompt, output_len), gap in zip(shapes, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, output_len)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    result: dict[str, Any] = {
        "tool": "loadtest/bench_serving.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {**cfg.public(), "model": model, "prompt_words": None if tokenizer else words},
        "summary": summarize(
            records,
            duration,
            cfg.percentiles,
            cfg.output_len if cfg.ignore_eos and not cfg.range_ratio else None,
        ),
    }
    if cfg.save_details:
        result["requests"] = [
            {
                k: getattr(r, k)
                for k in ("ttft", "latency", "output_tokens", "prompt_tokens", "itl", "error")
            }
            for r in records
        ]
    return result


def run_benchmark(config: BenchConfig | dict[str, Any]) -> dict[str, Any]:
    """Run one benchmark to completion; `config` is a BenchConfig or its fields as a dict."""
    cfg = config if isinstance(config, BenchConfig) else BenchConfig(**config)
    return asyncio.run(arun_benchmark(cfg))


# --- command line ---------------------------------------------------------------------------------


def format_summary(result: dict[str, Any]) -> str:
    s, c = result["summary"], result["config"]
    rows = [
        ("Model", c["model"]),
        ("Request rate (req/s)", c["request_rate"]),
        ("Max concurrency", c["max_concurrency"] or "-"),
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
        ("Mean concurrency", f"{s['concurrency']:.2f}"),
    ]
    lines = [f"{' Serving Benchmark Result ':=^60}"] + [f"{k + ':':<44}{v}" for k, v in rows]
    for key, title in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ):
        lines.append(f"{' ' + title + ' (ms) ':-^60}")
        for stat, value in s[key].items():
            lines.append(f"{stat:<44}{'-' if value is None else f'{value:.2f}'}")
    if s["wrong_output_len"]:
        lines.append(
            f"WARNING: {s['wrong_output_len']} requests did not produce --output-len tokens"
        )
    for error, count in s["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines + ["=" * 60])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="req/s, Poisson; inf (default) = all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (see --tokenizer, --no-calibrate)"
    )
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, exact with ignore_eos")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each request's input/output length from [len * (1 - r), len] (vLLM's name)",
    )
    p.add_argument(
        "--api-key", default=None, help="default: $DSASERVE_API_KEY, else $OPENAI_API_KEY"
    )
    p.add_argument("--endpoint", default="/v1/chat/completions")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or model folder for exact prompt lengths"
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="count --input-len in words, send no probe requests",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument(
        "--label", default=None, help="name of this run in reports (default: the file name)"
    )
    p.add_argument("--output", default=None, help="write the result JSON here")
    p.add_argument(
        "--save-details", action="store_true", help="include per-request timings in the JSON"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = BenchConfig(
        base_url=a.base_url,
        model=a.model,
        num_prompts=a.num_prompts,
        request_rate=a.request_rate,
        max_concurrency=a.max_concurrency,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.random_range_ratio,
        api_key=a.api_key or os.environ.get("DSASERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        endpoint=a.endpoint,
        ignore_eos=not a.no_ignore_eos,
        tokenizer=a.tokenizer,
        calibrate=not a.no_calibrate,
        seed=a.seed,
        timeout_s=a.timeout,
        percentiles=tuple(float(p) for p in a.percentiles.split(",")),
        label=a.label,
        save_details=a.save_details,
    )
    result = run_benchmark(cfg)
    print(format_summary(result))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["summary"]["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
