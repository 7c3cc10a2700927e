"""Data-parallel workers in the disaggregated stack, as real processes: a prefill worker of two
data-parallel ranks with expert parallelism on one host (its rank 1 a process it starts), and a
decode worker of two ranks spread over two "nodes" on loopback (`--nnodes 2 --node-rank k
--master-addr/--master-port`, torchrun's names). Every rank registers as a worker of its own, so
the router (round robin) sends requests to each; each rank pulls the KV it decodes; answers
equal one engine's offline generation, and every rank's pages come back.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from dsaserve.engine.llm import LLM
from dsaserve.engine.ports import free_port
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.text.chat_format import chat_format
from dsaserve.services.registry import worker_key
from tests.serving_stack import Stack, openai_client, wait_all_kv_free

pytestmark = pytest.mark.e2e  # workers of several ranks as processes

MESSAGES = [{"role": "user", "content": "Count the ways."}]
EP = ("--data-parallel-size", "2", "--enable-expert-parallel")
ROUNDS = 4  # round robin: requests on each rank
TOKENS = 12


def test_data_parallel_ranks_serve_as_workers_of_their_own_across_two_nodes(
    tiny, redis_url, tmp_path
):
    with LLM(tiny) as one:  # what one engine answers (as `dsaserve generate --chat` does)
        prompt = one.tokenizer.encode(chat_format(tiny, one.tokenizer).render(MESSAGES))
        [offline] = one.generate([prompt], SamplingParams(max_tokens=TOKENS, temperature=0))
    s = Stack(tiny, redis_url, tmp_path)
    try:
        port, metrics = free_port(), free_port()
        prefill = s.worker("prefill", *EP, port=port, metrics_port=metrics)
        # rank 1 of the prefill worker: the next ports, under its rank's id
        prefill1 = dataclasses.replace(
            prefill, name="prefill-0-dp1", port=port + 1, metrics_port=metrics + 1
        )
        master = ("--master-addr", "127.0.0.1", "--master-port", str(free_port()))
        nodes = [
            s.worker("decode", *EP, "--nnodes", "2", "--node-rank", str(k), *master)
            for k in range(2)
        ]
        router = s.router("--policy", "round_robin")
        s.wait_ready(prefill, prefill1, *nodes)
        url = s.wait_healthy(router, prefill=2, decode=2)  # round robin over all four
        registry = redis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            for name in ("prefill-0-dp0", "prefill-0-dp1", "decode-1-dp0", "decode-2-dp1"):
                assert registry.exists(worker_key(name)), name
        finally:
            registry.close()
        with openai_client(url) as c, ThreadPoolExecutor(ROUNDS) as pool:
            ask = lambda _: c.chat.completions.create(
                model=tiny.name, messages=MESSAGES, max_tokens=TOKENS, temperature=0
            )
            for res in pool.map(ask, range(ROUNDS)):  # at once: both engines compute together
                assert res.choices[0].message.content == offline.text
        for role, ranks in (("prefill", (prefill, prefill1)), ("decode", nodes)):
            done = [
                r.counter("dsaserve_worker_requests_total", role=role, outcome="ok") for r in ranks
            ]
            assert sum(done) == ROUNDS and min(done) >= 1, (role, done)  # each rank served
        wait_all_kv_free(prefill, prefill1, *nodes)
    finally:
        s.stop()
