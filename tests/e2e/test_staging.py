"""Both ways a decode worker pulls KV, through the real stack (redis-server, workers and router
as processes, NIXL over loopback, gRPC): from a prefill worker with room in its staging blocks,
and from one without, which hands out its pages instead. The answers agree and nothing leaks.
"""

from __future__ import annotations

import urllib.request

import grpc
import httpx
import pytest

from dsaserve.engine.kv.layout import (
    SLAB,
    STAGING,
    KVBudgetError,
    KVCacheConfig,
    plan_pages,
    staging_block_bytes,
)
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.services.auth import token_metadata
from dsaserve.services.rpc import grpc_api, pb
from tests.serving_stack import TOKEN, Proc, Stack, wait_for

pytestmark = pytest.mark.e2e  # the router and both workers as processes

PROMPTS = [f"Where does river number {i} meet the sea?" for i in range(4)]
SEQS, BATCHED = 32, 1024  # what tests/serving_stack.py gives every worker


def budget_without_staging_room(model) -> int:
    """A KV budget whose share for staged requests is under one block (float32 pools)."""
    cfg = ModelConfig.from_dir(model)
    block = staging_block_bytes(cfg, 64, 4)

    def plans(budget: int) -> bool:
        try:
            plan_pages(cfg, KVCacheConfig(budget, 64, SEQS, BATCHED), 4, block)
        except KVBudgetError:
            return False
        return True

    low, high = 1, 1 << 30  # the fixed cost lies between
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if plans(mid) else (mid, high)
    budget = high + 8 * block  # room for a few requests' pages, not for one staged block
    assert plan_pages(cfg, KVCacheConfig(budget, 64, SEQS, BATCHED), 4, block)[1] == 0
    return budget


def prefilled_groups(worker: Proc, rid: str) -> set[str]:
    """Where a prefill worker holds a fresh request's KV (the groups of its handle)."""
    with grpc.insecure_channel(worker.address) as channel:
        stub, metadata = grpc_api.PrefillStub(channel), token_metadata(TOKEN)
        request = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=list(range(3, 90)),
            sampling=pb.SamplingParams(max_tokens=4, temperature=0),
        )
        groups = set(stub.Prefill(request, metadata=metadata, timeout=60).kv.pages)
        assert stub.Release(pb.ReleaseRequest(request_id=rid), metadata=metadata).intact
    return groups


def prefills_served(worker: Proc) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dsaserve_worker_requests_total{") and 'outcome="ok"' in line:
                return float(line.split()[-1])
    return 0.0


def test_staged_and_page_pulls_give_the_same_answers(tiny, redis_server, tmp_path):
    s = Stack(tiny, redis_server, tmp_path)
    try:
        roomy = s.worker("prefill")
        tight = s.worker(
            "prefill", "--kv-cache-memory-bytes", str(budget_without_staging_room(tiny))
        )
        decode = s.worker("decode")
        router = s.router("--policy", "round_robin")
        s.wait_ready(roomy, tight, decode)
        url = s.wait_healthy(router, prefill=2)  # round robin over both
        assert prefilled_groups(roomy, "probe-roomy") == {STAGING}
        assert prefilled_groups(tight, "probe-tight") == {"swa", "csa", "hca", SLAB}

        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answers = {}
        for prompt in PROMPTS:  # twice each in a row: round robin gives each worker one
            for _ in range(2):
                r = httpx.post(
                    url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": prompt}], **body},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
                answers.setdefault(prompt, []).append(r.json()["choices"][0]["message"]["content"])
        assert all(a == b for a, b in answers.values()), answers
        # Each worker prefilled its probe and one of each pair.
        assert prefills_served(roomy) == prefills_served(tight) == 1 + len(PROMPTS)
        for worker in (roomy, tight, decode):
            wait_for(worker.all_kv_free, 30, f"{worker.name} to free every page and block")
    finally:
        s.stop()
