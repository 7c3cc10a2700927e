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

Workloads (`--dataset-name`):
  random                   every prompt new (no two share a prefix), --input-len long
  generated-shared-prefix  SGLang's: --gsp-num-groups groups, each a system prompt of
                           --gsp-system-prompt-len tokens and --gsp-prompts-per-group questions
                           of --gsp-question-len, all sent in random order
  multi-turn               --num-prompts conversations of --multi-turn-turns turns: each turn
                           sends the conversation so far (its answers included) and a new
                           question of --input-len tokens, once the last turn has answered
The report gives the prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens over
prompt tokens) beside TTFT.

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
from collections.abc import Callable, Sequence
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
    dataset: str = "random"  # DATASETS
    gsp_num_groups: int = 8
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    multi_turn_turns: int = 4

    def public(self) -> dict[str, Any]:
        """The config as recorded in results: never the key, and inf as a JSON-safe string."""
        out = dataclasses.asdict(self)
        out.pop("api_key")
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


DATASETS = ("random", "generated-shared-prefix", "multi-turn")

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
    cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        # of the prompt tokens, those the server resumed from its prefix cache
        "cache_hit_rate": cached_tokens / input_tokens if input_tokens else None,
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


@dataclass
class Conversation:
    """Requests sent one after another: `first`, then each of `questions` appended to the
    conversation so far (the answers included)."""

    first: str | list[dict[str, str]]  # the user's message, or the first request's messages
    output_len: int
    questions: list[str] = dataclasses.field(default_factory=list)


def conversations(
    cfg: BenchConfig,
    rng: random.Random,
    words: Callable[[int], int],
    tokenizer: Any = None,
) -> list[Conversation]:
    """The run's requests; words(n): the words that make n prompt tokens."""
    prompt = lambda n: make_prompt(drawn_length(words(n), cfg.range_ratio, rng), rng, tokenizer)
    output = lambda: drawn_length(cfg.output_len, cfg.range_ratio, rng)
    if cfg.dataset == "random":
        return [Conversation(prompt(cfg.input_len), output()) for _ in range(cfg.num_prompts)]
    if cfg.dataset == "multi-turn":
        return [
            Conversation(
                prompt(cfg.input_len),
                output(),
                [prompt(cfg.input_len) for _ in range(cfg.multi_turn_turns - 1)],
            )
            for _ in range(cfg.num_prompts)
        ]
    if cfg.dataset != "generated-shared-prefix":
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}")
    out = []
    for _ in range(cfg.gsp_num_groups):
        system = make_prompt(words(cfg.gsp_system_prompt_len), rng, tokenizer)
        for _ in range(cfg.gsp_prompts_per_group):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": prompt(cfg.gsp_question_len)},
            ]
            out.append(Conversation(messages, cfg.gsp_output_len))
    rng.shuffle(out)
    return out


async def send_request(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    prompt: str | list[dict[str, str]],
    output_len: int,
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


async def prompt_probes(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, rng: random.Random
) -> list[tuple[int, int]] | None:
    """(words, prompt tokens) of two 1-token probe requests (calibrated_words turns them into
    words per prompt length); None when calibration is off or the probes fail (a warning: then
    lengths count words). The probes also open the first connection, so that cost stays out of
    the measured run."""
    if not cfg.calibrate:
        return None
    probes = []
    for words in PROBE_WORDS:
        record = await send_request(client, cfg, model, make_prompt(words, rng), 1)
        if not record.ok or record.prompt_tokens is None:
            print(
                f"warning: no prompt calibration ({record.error or 'no usage'}); "
                "lengths count words",
                file=sys.stderr,
            )
            return None
        probes.append((words, record.prompt_tokens))
    return probes


async def arun_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
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
        probes = await prompt_probes(client, cfg, model, rng) if tokenizer is None else None
        words = lambda tokens: calibrated_words(tokens, probes) if probes else tokens
        convs = conversations(cfg, rng, words, tokenizer)
        gaps = arrival_gaps(len(convs), cfg.request_rate, rng)

        async def one(prompt: str | list[dict[str, str]], output_len: int) -> StreamRecord:
            if gate is None:
                return await send_request(client, cfg, model, prompt, output_len)
            async with gate:
                return await send_request(client, cfg, model, prompt, output_len)

        async def converse(conv: Conversation) -> list[StreamRecord]:
            messages = conv.first
            records = [await one(messages, conv.output_len)]
            for question in conv.questions:
                if not records[-1].ok:
                    break
                if isinstance(messages, str):
                    messages = [{"role": "user", "content": messages}]
                answer = {"role": "assistant", "content": "".join(records[-1].text)}
                messages = [*messages, answer, {"role": "user", "content": question}]
                records.append(await one(messages, conv.output_len))
            return records

        start = time.perf_counter()
        tasks = []
        for conv, gap in zip(convs, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(converse(conv)))
        records = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - start

    result: dict[str, Any] = {
        "tool": "loadtest/bench_serving.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            **cfg.public(),
            "model": model,
            "prompt_words": None if tokenizer else words(cfg.input_len),
        },
        "summary": summarize(
            records,
            duration,
            cfg.percentiles,
            cfg.output_len
            if cfg.ignore_eos and not cfg.range_ratio and cfg.dataset != "generated-shared-prefix"
            else None,
        ),
    }
    if cfg.save_details:
        result["requests"] = [
            {
                k: getattr(r, k)
                for k in (
                    "ttft",
                    "latency",
                    "output_tokens",
                    "prompt_tokens",
                    "cached_tokens",
                    "itl",
                    "error",
                )
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
        (
            "Prefix cache hit rate",
            "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.3f}",
        ),
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
    p.add_argument("--dataset-name", choices=DATASETS, default="random", help="the workload")
    p.add_argument("--gsp-num-groups", type=int, default=8, help="shared system prompts")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16, help="questions per prompt")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="its tokens")
    p.add_argument("--gsp-question-len", type=int, default=128, help="tokens of a question")
    p.add_argument("--gsp-output-len", type=int, default=256, help="max_tokens of each answer")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="turns per conversation")
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
        dataset=a.dataset_name,
        gsp_num_groups=a.gsp_num_groups,
        gsp_prompts_per_group=a.gsp_prompts_per_group,
        gsp_system_prompt_len=a.gsp_system_prompt_len,
        gsp_question_len=a.gsp_question_len,
        gsp_output_len=a.gsp_output_len,
        multi_turn_turns=a.multi_turn_turns,
    )
    result = run_benchmark(cfg)
    print(format_summary(result))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["summary"]["completed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
