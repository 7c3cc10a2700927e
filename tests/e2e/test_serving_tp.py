"""Tensor-parallel groups of different sizes in the disaggregated stack, as real processes.

A prefill worker of two ranks holds its KV in rank 0's pools (every rank holds the same); a
decode worker of one rank pulls it from there, and so does one of two ranks, whose rank 0 then
shares it with its other rank. Their layout hashes match (a page is the same bytes at any
tensor-parallel size) and both answer what `dsaserve generate` answers, at one rank and at two.
A worker whose follower rank dies cannot step: it leaves the registry and exits.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from dsaserve.services.registry import worker_key
from tests.serving_stack import Stack, offline_generate, openai_client, wait_for

pytestmark = pytest.mark.e2e  # workers of several ranks as processes

MESSAGES = [{"role": "user", "content": "Count the ways."}]
ROUNDS = 4  # round robin: two requests on each decode worker
TOKENS = 12


def test_groups_of_different_sizes_answer_like_offline_generation(tiny, redis_url, tmp_path):
    # one rank's answer (two ranks compute the same: tests/engine/test_tensor_parallel.py)
    offline = offline_generate(tiny, MESSAGES, TOKENS)
    s = Stack(tiny, redis_url, tmp_path)
    try:
        prefill = s.worker("prefill", "-tp", "2")
        narrow, wide = s.worker("decode"), s.worker("decode", "-tp", "2")
        router = s.router("--policy", "round_robin")
        s.wait_ready(prefill, narrow, wide)
        url = s.wait_healthy(router, decode=2)  # round robin over both
        with openai_client(url) as c:
            for _ in range(ROUNDS):
                res = c.chat.completions.create(
                    model=tiny.name, messages=MESSAGES, max_tokens=TOKENS, temperature=0
                )
                assert res.choices[0].message.content == offline["text"]
                assert res.usage.completion_tokens == len(offline["token_ids"])
        for decode in (narrow, wide):
            served = decode.counter("dsaserve_worker_requests_total", role="decode", outcome="ok")
            assert served == ROUNDS // 2, decode.name
        for worker in (prefill, narrow, wide):
            wait_for(worker.all_kv_free, 20, f"{worker.name} to free all KV")
    finally:
        s.stop()


def _followers(pid: int) -> list[int]:
    """The tensor-parallel ranks a worker spawned (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(c)
        for c in children
        if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text().replace("\0", " ")
    ]


def test_a_worker_whose_rank_dies_leaves_the_registry_and_exits(tiny, redis_url, tmp_path):
    s = Stack(tiny, redis_url, tmp_path)
    try:
        worker = s.worker("decode", "-tp", "2")
        s.wait_ready(worker)
        registry = redis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            assert registry.exists(worker_key(worker.name))
            [rank1] = _followers(worker.proc.pid)
            os.kill(rank1, signal.SIGKILL)
            worker.proc.wait(timeout=60)
            assert registry.exists(worker_key(worker.name)) == 0  # deregistered, not expired
        finally:
            registry.close()
        assert "a tensor-parallel rank of the engine died" in worker.log.read_text()
    finally:
        s.stop()
