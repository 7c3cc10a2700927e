"""loadtest/cluster.py at small scale: simulated prefill and decode workers (the real services,
pages, leases, prefix caches and KV pulls; no model compute), two routers, a real redis-server,
and a few hundred multi-turn streams over shared system prompts. Every stream is answered, none
hangs, every worker's pages come back, and the report's figures are there and sane."""

from __future__ import annotations

import pytest

from loadtest.cluster import ClusterConfig, run_cluster
from loadtest.router_cpu import RouterBenchConfig, run

pytestmark = pytest.mark.e2e  # a cluster of processes


def test_a_small_simulated_cluster_serves_every_stream_and_gets_every_page_back(tmp_path):
    cfg = ClusterConfig(prefill=2, decode=2, routers=2, rate=15, duration_s=4, output_len=8)
    result = run_cluster(cfg, tmp_path)
    assert result["requests"] >= 120
    assert result["ok"] == result["requests"], result["errors"]
    assert result["hung"] == 0 and result["pages_back"]
    assert 0 < result["streams_in_flight"]["mean"] <= result["streams_in_flight"]["peak"] <= 1000
    counts = result["requests_per_worker"]
    assert sum(v for k, v in counts.items() if k.startswith("decode")) == result["requests"]
    assert all(v > 0 for v in counts.values())  # every worker took work
    cache = result["cache"]
    assert 0 < cache["hit_rate"] <= cache["best_possible"] < 1
    assert all(c > 0 for c in result["routers"]["cpu_us_per_token"])


def test_the_router_cpu_bench_counts_every_token_of_both_routers():
    """loadtest/router_cpu.py: the lean client's count of each stream's tokens (the last
    chunk's usage) and the router CPU it is divided into, for the candidate router and one
    running another ref's code (here the same commit: the compare path, not a speed-up). The
    decode worker streams 3 tokens a message (--stream-interval): 8 tokens come in at most 4
    content chunks (the first token from prefill, then 3 + 3 + 1), with the same usage."""
    cfg = RouterBenchConfig(
        concurrency=8, output_len=8, seconds=3, decode=1, baseline="HEAD", stream_interval=3
    )
    result = run(cfg)
    assert [p["router"] for p in result["phases"]] == ["candidate", "baseline"]
    for phase in result["phases"]:
        assert phase["streams"] >= 8 and phase["ok"] == phase["streams"], phase["errors"]
        assert phase["tokens"] == 8 * phase["ok"]
        assert phase["ok"] <= phase["chunks"] <= 4 * phase["ok"]
        assert phase["router_cpu_us_per_token"] > 0 and phase["gap_ms"]["p50"] is not None
    assert result["baseline_over_candidate"] > 0
