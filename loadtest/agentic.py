"""An agentic benchmark through `dsaserve up`: multi-turn tool-using conversations, replayed on
a stack with the prefix cache (the default) and on one without, in one run.

    python -m loadtest.agentic --output bench/results/cpu-agentic.json

The trace is shaped like the published agentic ones (Dynamo's V4 recipes replay agent traces of
64K-token prompts, 400-token answers, 90% of each prompt reused), scaled to the built-in model's
2,048-token context: --conversations conversations share a system prompt and a tool list
(--system tokens); each begins with a task (--task) and each turn appends the model's answer
(--answer tokens, greedy) and a tool result (--result), so ~90% of a turn's prompt is the turn
before's. Conversations take turns round-robin, so the caches hold several at once, and one
request is in flight at a time, so the workers' counters between two requests are that
request's own.

Per turn: prompt tokens computed and cached (the answer's `cached_tokens`), the best the stack
could have cached (everything an earlier request computed: the turn before's prompt and answer
but the answer's last token, sampled and never fed back; for a conversation's first turn, the
shared system prompt once another conversation sent it), the KV pages and bytes the decode
worker pulled (`dsaserve_kv_pulled_pages_total`, `dsaserve_kv_transfer_bytes_total`) against the
pages the turn adds (every window ring page, and the entry pages past those the decode worker
holds: engine.kv.layout.pages_past), those the prefill worker borrowed (the last answer's state),
and TTFT. The summary: the hit rate (cached / prompt
tokens) against the best possible (Dynamo's V4-Pro agentic recipe reads 42.7% of its prompts from
cache where 94% was possible), and each figure with the cache over without it.

It also times the issue's probe: a 1,500-token prefix plus a question, once fresh (a miss) and
once after the prefix plus one token was sent (a hit: the question resumes at the prefix's end),
medians of --probes prefixes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dsaserve.engine import models
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import pages_past
from loadtest.openai_stream import StreamRecord
from loadtest.prompts import make_prompt
from loadtest.up_stack import UpStack

TOOLS = [
    {"name": name, "description": doc, "parameters": {"type": "object", "properties": props}}
    for name, doc, props in (
        ("read_file", "Read a file of the repository", {"path": {"type": "string"}}),
        ("grep", "Search the repository", {"pattern": {"type": "string"}}),
        ("run_tests", "Run the test suite", {"filter": {"type": "string"}}),
        ("edit_file", "Replace text in a file", {"path": {"type": "string"}}),
    )
]
PAGE = 64  # the workers' --block-size (default)


class Client:
    """The stack's router: token ids of a text, one streamed completion of token ids."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=600)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def ids(self, text: str, n: int | None = None) -> list[int]:
        """The token ids of `text` (its first n)."""
        r = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"][:n]

    def complete(self, prompt: list[int], max_tokens: int) -> StreamRecord:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        record = StreamRecord(start=time.perf_counter())
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                record.feed(line, time.perf_counter())
        record.finish(time.perf_counter())
        if not record.ok:
            raise RuntimeError(f"a completion failed: {record.error}")
        return record


def words(client: Client, n: int, rng: random.Random) -> list[int]:
    """n tokens of random words."""
    return client.ids(make_prompt(n, rng), n)


def replay(stack: UpStack, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The trace through one stack: a record per turn."""
    client, rng = Client(stack.url), random.Random(args.seed)
    system = client.ids(
        "You are a coding agent. Call a tool, read its result, go on until done. Tools: "
        + json.dumps(TOOLS)
        + " Rules: "
        + make_prompt(args.system, rng),
        args.system,
    )
    cfg = models.family(DEMO_MODEL_DIR).ModelConfig.from_dir(DEMO_MODEL_DIR)
    prompts = [system + words(client, args.task, rng) for _ in range(args.conversations)]
    computed: list[int] = [0] * args.conversations  # what the stack computed of each so far
    turns = []
    for turn in range(args.turns):
        for c, prompt in enumerate(prompts):
            before = counters(stack)
            record = client.complete(prompt, args.answer)
            after = counters(stack)
            # everything an earlier request computed of this prompt
            best = computed[c] if turn else (len(system) if c else 0)
            assert record.prompt_tokens == len(prompt) and record.cached_tokens is not None
            turns.append(
                {
                    "conversation": c,
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "cached_tokens": record.cached_tokens,
                    "computed_tokens": len(prompt) - record.cached_tokens,
                    "best_cached_tokens": best,
                    **{key: after[key] - before[key] for key in after},
                    "new_pages": pages_past(cfg, PAGE, len(prompt), best // PAGE * PAGE),
                    "ttft_s": record.ttft,
                }
            )
            answer = client.ids("".join(record.text))
            computed[c] = len(prompt) + len(answer) - 1
            prompts[c] = prompt + answer + words(client, args.result, rng)
    return turns


def counters(stack: UpStack) -> dict[str, float]:
    """What the workers pulled so far: the decode worker the prompts' KV, the prefill worker
    the last answers' state it borrowed."""
    return {
        f"{kind}_{unit}": stack.metric(role, f"dsaserve_kv_{metric}_total")
        for kind, role in (("pulled", "decode"), ("borrowed", "prefill"))
        for unit, metric in (("pages", "pulled_pages"), ("bytes", "transfer_bytes"))
    }


def probe(stack: UpStack, args: argparse.Namespace) -> dict[str, float]:
    """Median TTFT of a 1,500-token prefix + a question: fresh, and after the prefix + one
    token was sent (the question then resumes at the prefix's end)."""
    client, rng = Client(stack.url), random.Random(args.seed + 1)
    miss, hit = [], []
    for _ in range(args.probes):
        question = client.ids(" Q: what happened next? A:")
        miss.append(client.complete(words(client, 1500, rng) + question, 1).ttft)
        prefix = words(client, 1500, rng)
        client.complete(prefix + question[:1], 1)
        hit.append(client.complete(prefix + question, 1).ttft)
    return {"miss_ttft_s": statistics.median(miss), "hit_ttft_s": statistics.median(hit)}


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    best = sum(t["best_cached_tokens"] for t in turns)
    return {
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "hit_rate": cached / prompt,
        "best_hit_rate": best / prompt,
        "hit_rate_of_best": cached / best if best else 0.0,
        **{
            key: sum(t[key] for t in turns)
            for key in ("pulled_pages", "pulled_bytes", "borrowed_pages", "borrowed_bytes")
        },
        "turns_pulling_more_than_new_pages_plus_one": sum(
            t["pulled_pages"] > t["new_pages"] + 1 for t in turns
        ),
        "mean_ttft_s": statistics.mean(t["ttft_s"] for t in turns),
        "mean_ttft_s_after_first_turn": statistics.mean(t["ttft_s"] for t in turns if t["turn"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=7)
    p.add_argument("--system", type=int, default=600, help="tokens of system prompt and tools")
    p.add_argument("--task", type=int, default=60, help="tokens of a conversation's task")
    p.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    p.add_argument("--result", type=int, default=150, help="tokens of each tool result")
    p.add_argument("--probes", type=int, default=3, help="prefixes the TTFT probe times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="the run record (JSON)")
    args = p.parse_args()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, flags in (("cache", []), ("no_cache", ["--no-enable-prefix-caching"])):
            with UpStack(flags, Path(logs) / f"{name}.log") as stack:
                turns = replay(stack, args)
                runs[name] = {"summary": summarize(turns), "probe": probe(stack, args)}
                runs[name]["turns"] = turns
    on, off = runs["cache"], runs["no_cache"]
    ratios = {
        key: on["summary"][key] / off["summary"][key]
        for key in ("computed_tokens", "pulled_pages", "pulled_bytes", "mean_ttft_s")
        if off["summary"][key]
    }
    probe_ratio = on["probe"]["hit_ttft_s"] / on["probe"]["miss_ttft_s"]
    record = {"args": vars(args), "runs": runs, "with_over_without": ratios}
    record["probe_hit_over_miss"] = probe_ratio
    for name, run in runs.items():
        s = run["summary"]
        print(
            f"{name:9s} hit rate {s['hit_rate']:.1%} of {s['best_hit_rate']:.1%} possible "
            f"({s['hit_rate_of_best']:.1%} of the best), computed {s['computed_tokens']} of "
            f"{s['prompt_tokens']} prompt tokens; decode pulled {s['pulled_pages']:.0f} pages "
            f"({s['pulled_bytes'] / 2**20:.1f} MiB; turns over new pages + 1: "
            f"{s['turns_pulling_more_than_new_pages_plus_one']}), prefill borrowed "
            f"{s['borrowed_pages']:.0f} ({s['borrowed_bytes'] / 2**20:.1f} MiB); mean TTFT "
            f"{s['mean_ttft_s'] * 1000:.0f} ms"
        )
    print("with the cache / without:", {k: round(v, 3) for k, v in ratios.items()})
    print(
        f"1,500-token prefix + a question: hit TTFT {on['probe']['hit_ttft_s'] * 1000:.0f} ms, "
        f"miss {on['probe']['miss_ttft_s'] * 1000:.0f} ms ({probe_ratio:.2f}x)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
