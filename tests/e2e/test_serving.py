"""The disaggregated stack end to end: real redis-server, real NIXL over loopback, real gRPC
and HTTP, each service its own process, and the official OpenAI client; the module's stack (one
prefill worker, one decode worker and a router) on the tiny V4 model. At the end, DeepSeek-V3.2's
own: `dsaserve up` serving a tiny V3.2 checkpoint (the release's chat encoder: thinking into
reasoning_content, DSML function_calls into tool_calls, /tokenize; a prompt sent again resumed
from the prefix cache), and a V3.2 prefill worker that a V4 decode worker refuses to pair with;
then DeepSeek-V4.1's: `dsaserve up` serving the independent reference's tokens, prefix-cache
resumes, chats by deepseek-recipe, images refused; workers exporting Engram's counters."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis

from dsaserve.engine.ports import free_port
from dsaserve.engine.text.chat_format import ChatOptions, V41Chat
from dsaserve.services.auth import token_metadata
from dsaserve.services.registry import unseal, worker_key
from dsaserve.services.rpc import grpc_api, pb
from tests import REPO_ROOT
from tests.engine_cases import byte_ids
from tests.model_fixtures import DEFAULT_FAMILY, FAMILIES, families
from tests.reference_v41 import ReferenceV41
from tests.serving_stack import (
    FORECAST,
    START_TIMEOUT_S,
    TOKEN,
    Stack,
    StackSpec,
    http_status,
    in_db,
    offline_generate,
    openai_client,
    refresh_age,
    router_health,
    serving,
    wait_all_kv_free,
    wait_for,
    wait_for_a_refresh,
)

pytestmark = pytest.mark.e2e  # the router and both workers as processes

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers."},
]


def test_chat_completion_equals_offline_generation(stack, client, tiny):
    offline = offline_generate(tiny, MESSAGES, 24)
    res = client.chat.completions.create(
        model=tiny.name, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert res.choices[0].message.content == offline["text"]
    assert res.choices[0].finish_reason == offline["finish_reason"]
    assert res.usage.completion_tokens == len(offline["token_ids"])
    stream = client.chat.completions.create(
        model=tiny.name,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline["text"]
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]
    assert (
        chunks[-1].usage.completion_tokens == len(offline["token_ids"]) and chunks[-1].choices == []
    )
    wait_all_kv_free(stack.prefill, stack.decode)


def test_text_completion_with_stop_string(stack, client, tiny):
    full = client.completions.create(
        model=tiny.name, prompt="Once upon a time", max_tokens=40, temperature=0
    )
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = client.completions.create(
        model=tiny.name, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop]
    )
    assert (
        cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    )


def test_sixteen_concurrent_streams_equal_their_sequential_answers(stack, client, tiny):
    prompts = [
        [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5)}] for i in range(16)
    ]

    def ask(messages, stream: bool) -> str:
        if not stream:
            r = client.chat.completions.create(
                model=tiny.name, messages=messages, max_tokens=20, temperature=0
            )
            return r.choices[0].message.content
        chunks = client.chat.completions.create(
            model=tiny.name, messages=messages, max_tokens=20, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    sequential = [ask(p, stream=False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_answers = list(pool.map(lambda p: ask(p, stream=True), prompts))
    assert concurrent_answers == sequential
    wait_all_kv_free(stack.prefill, stack.decode)


def test_clients_that_disconnect_mid_stream_leave_nothing_allocated(stack, tiny):
    body = {
        "model": tiny.name,
        "messages": MESSAGES,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(3):
        with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [next(lines) for _ in range(6)]  # a few chunks in, then hang up
            assert any('"content"' in e for e in events)
    wait_all_kv_free(stack.prefill, stack.decode)


def test_clients_that_hang_up_mid_prefill_are_aborted_on_both_workers(stack, tiny):
    """16 clients send long prompts and hang up once the prefill worker has started on them:
    the router notices (nothing reads the connection while a request waits for its prefill),
    aborts them, and the prefill worker stops computing their prompts."""
    completed_before = stack.prefill.counter(
        "dsaserve_worker_requests_total", role="prefill", outcome="ok"
    )
    sockets = []
    for i in range(16):  # distinct prompts: no prefix cache hits
        prompt = " ".join(f"{i}-{j}" for j in range(600))
        body = json.dumps({"model": tiny.name, "prompt": prompt, "max_tokens": 4}).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = socket.create_connection(("127.0.0.1", int(stack.url.rsplit(":", 1)[1])), 10)
        sock.sendall(request + body)
        sockets.append(sock)
    wait_for(lambda: stack.prefill.load().running, 60, "the prefill worker to start on them")
    for sock in sockets:
        sock.close()
    wait_for(
        lambda: router_gauge(stack.url, "dsaserve_router_inflight_requests") == 0,
        30,
        "the router's in-flight requests to return to 0",
    )
    wait_all_kv_free(stack.prefill, stack.decode)
    completed = (
        stack.prefill.counter("dsaserve_worker_requests_total", role="prefill", outcome="ok")
        - completed_before
    )
    assert completed < 16  # (all 16 were computed to the end before)


def test_a_flushed_registry_under_load_answers_every_request(stack, tiny):
    """FLUSHALL (a Redis restarted, or flushed by hand) while requests run: the workers are
    alive, so the router keeps them until they write their records again; nothing gets a 503."""
    body = {"model": tiny.name, "prompt": "The river", "max_tokens": 4}
    stop = threading.Event()

    def client() -> list[int]:
        statuses = []
        while not stop.is_set():
            response = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
            statuses.append(response.status_code)
        return statuses

    with (
        concurrent.futures.ThreadPoolExecutor(4) as pool,
        redis.Redis.from_url(stack.redis_url, socket_timeout=5) as registry,
    ):
        clients = [pool.submit(client) for _ in range(4)]
        try:
            for _ in range(3):
                flush_between_a_refresh_and_a_beat(stack, registry)
                # the router's next refresh finds nobody: it keeps them while they write again
                wait_for_a_refresh(stack.url)
                assert router_health(stack.url)["workers"] == {"prefill": 1, "decode": 1}
        finally:
            stop.set()
        statuses = [status for c in clients for status in c.result()]
    assert statuses and set(statuses) == {200}, collections.Counter(statuses)
    wait_all_kv_free(stack.prefill, stack.decode)


def flush_between_a_refresh_and_a_beat(stack: Stack, registry: redis.Redis) -> None:
    """FLUSHALL at a moment the router's next refresh (every TTL/2) comes before the prefill
    worker's next heartbeat (every TTL/3), so that refresh finds an empty registry."""
    key = worker_key(stack.prefill.name)

    def flushed() -> bool:
        next_refresh = stack.ttl / 2 - refresh_age(stack.url)
        since_beat = stack.ttl - registry.pttl(key) / 1000
        if next_refresh + 0.3 < stack.ttl / 3 - since_beat:
            registry.flushall()
            return True
        return False

    wait_for(flushed, 30, "a refresh due well before the next heartbeat")


def test_an_idle_worker_costs_almost_no_cpu(stack):
    """No thread of an idle worker spins: NIXL's UCX progress thread waits for events instead of
    polling with a zero timeout (it took a whole core of an idle machine)."""
    wait_all_kv_free(stack.prefill, stack.decode)
    for worker in (stack.prefill, stack.decode):
        before, start = thread_cpu_seconds(worker.proc.pid), time.monotonic()
        time.sleep(2.0)  # the span measured, not a synchronisation
        after, span = thread_cpu_seconds(worker.proc.pid), time.monotonic() - start
        busiest = max(after[t] - before.get(t, 0.0) for t in after) / span
        assert busiest < 0.05, f"{worker.name}: a thread used {busiest:.0%} of a core while idle"


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process `pid`, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[task.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def router_gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 10}, 400, "context"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "'n'"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 7}, 400, "top_p"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        (
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "no-such-model",
        ),
    ],
)
def test_errors_have_openai_bodies(stack, tiny, body, status, fragment):
    r = httpx.post(
        stack.url + "/v1/chat/completions", json={"model": tiny.name, **body}, timeout=60
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and {"message", "type", "param", "code"} <= error.keys()
    wait_all_kv_free(stack.prefill, stack.decode)


def test_metrics_of_every_process(stack, client, tiny):
    client.chat.completions.create(
        model=tiny.name, messages=MESSAGES, max_tokens=4
    )  # at least one KV pull
    worker_text = "".join(
        httpx.get(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10).text
        for w in (stack.prefill, stack.decode)
    )
    dashboard = (REPO_ROOT / "deploy/grafana/dashboards/dsaserve.json").read_text()
    worker_series = {
        re.sub(r"_(bucket|sum|count)$", "", m)
        for m in re.findall(r"dsaserve_[a-z_]+", dashboard)
        if not m.startswith("dsaserve_router_")
    }
    assert worker_series, "the dashboard reads no worker series"
    for name in worker_series:  # every worker series the Grafana dashboard reads exists
        assert f"\n{name}" in worker_text or f"# HELP {name} " in worker_text, name
    decode_text = httpx.get(
        f"http://127.0.0.1:{stack.decode.metrics_port}/metrics", timeout=10
    ).text
    transferred = [
        line
        for line in decode_text.splitlines()
        if line.startswith("dsaserve_kv_transfer_bytes_total")
    ]
    assert transferred and float(transferred[0].split()[-1]) > 0
    router_text = httpx.get(stack.url + "/metrics", timeout=10).text
    assert "dsaserve_router_time_to_first_token_seconds_bucket" in router_text


def test_describe_needs_the_cluster_token_and_names_the_registered_agent(stack):
    """Describe hands out what a peer needs to READ this worker's memory: like every RPC it is
    refused without the cluster token; with it, it names the agent the worker registered."""
    with grpc.insecure_channel(stack.prefill.address) as channel:
        describe = grpc_api.PrefillStub(channel).Describe
        for metadata in ((), token_metadata("not-the-cluster-token")):
            with pytest.raises(grpc.RpcError) as refused:
                describe(pb.DescribeRequest(), metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        described = describe(pb.DescribeRequest(), metadata=token_metadata(TOKEN), timeout=10)
    with redis.Redis.from_url(stack.redis_url, socket_timeout=5) as registry:
        key = worker_key(stack.prefill.name)
        record = unseal(key, registry.get(key), TOKEN, time.time(), stack.ttl)
    assert described.agent_name == record.nixl_agent
    assert json.loads(described.descriptor)["agent"] == record.nixl_agent


def test_locust_scenario_runs_against_the_stack(stack):
    """The Locust scenario as a user runs it: the model comes from /v1/models, every request
    succeeds, and each reports its TTFT and ITL."""
    argv = [sys.executable, "-m", "locust", "--config", "loadtest/disagg.conf", "--host", stack.url]
    argv += ["--users", "2", "--spawn-rate", "2", "--run-time", "6s", "--stop-timeout", "20"]
    argv += ["--prompt-tokens", "16", "--max-tokens", "4", "--json"]
    root = REPO_ROOT
    out = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = {s["name"]: s for s in json.loads(out.stdout)}
    chat = stats["chat (stream)"]
    assert chat["num_requests"] >= 2 and chat["num_failures"] == 0, out.stderr[-3000:]
    assert stats["ttft"]["num_requests"] == chat["num_requests"]
    assert stats["models"]["num_failures"] == 0
    wait_all_kv_free(stack.prefill, stack.decode)


def test_killed_worker_leaves_routing_and_its_requests_fail_cleanly(tiny, redis_server, tmp_path):
    """SIGKILL a decode worker mid-stream: that stream ends with an error event (no hang), the
    worker drops out of routing, and new requests go to the surviving decode worker."""
    # A registry of its own (Redis database 1): the module's stack is still registered in 0.
    s = Stack(tiny, in_db(redis_server, 1), tmp_path, ttl=3.0)
    try:
        prefill, doomed, survivor = s.worker("prefill"), s.worker("decode"), s.worker("decode")
        router = s.router("--policy", "round_robin")
        s.wait_ready(prefill, doomed, survivor)
        url = s.wait_healthy(router, decode=2)
        body = {
            "model": tiny.name,
            "messages": MESSAGES,
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            victim = wait_for(
                lambda: next((w for w in (doomed, survivor) if w.load().running), None),
                30,
                "the stream to run on a decode worker",
            )
            os.kill(victim.proc.pid, signal.SIGKILL)
            rest = [e for e in lines if e]  # must end, not hang
        errors = [json.loads(e[6:]) for e in rest if e.startswith("data: {") and '"error"' in e]
        assert errors and errors[0]["error"]["message"] and rest[-1] == "data: [DONE]"
        alive = survivor if victim is doomed else doomed

        def decode_workers_routed() -> int:
            metrics = httpx.get(url + "/metrics", timeout=10).text
            line = next(
                ln
                for ln in metrics.splitlines()
                if ln.startswith('dsaserve_router_live_workers{role="decode"}')
            )
            return int(float(line.split()[-1]))

        # The killed worker's record expires (its TTL), then the router's next refresh drops it.
        # Waiting on the record itself keeps a late heartbeat of the survivor on a loaded
        # machine from looking like the victim's departure.
        registry = redis.Redis.from_url(s.redis_url, socket_timeout=5)
        try:
            wait_for(
                lambda: (
                    registry.exists(worker_key(victim.name)) == 0
                    and registry.exists(worker_key(alive.name))
                ),
                4 * s.ttl,
                "the killed worker's registry record to expire",
            )
        finally:
            registry.close()
        wait_for(
            lambda: decode_workers_routed() == 1, 4 * s.ttl, "the killed worker to leave routing"
        )
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            for _ in range(4):
                res = c.chat.completions.create(
                    model=tiny.name, messages=MESSAGES, max_tokens=8, temperature=0
                )
                assert res.choices[0].finish_reason == "length"
        wait_for(alive.all_kv_free, 20, "the survivor to free all KV")
        wait_for(
            prefill.all_kv_free, 20, "prefill to free all KV (the dead reader's lease included)"
        )
    finally:
        s.stop()


def test_api_keys_and_admission_limit_with_real_workers(stack, tiny, tmp_path):
    """A second router over the same workers, with an API key and room for one request only."""
    r = stack.router("--api-key", "k-123", "--max-inflight", "1", "--max-queue", "0")
    url = stack.wait_healthy(r)
    chat = {"model": tiny.name, "messages": MESSAGES, "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        res = httpx.post(url + "/v1/chat/completions", json=chat, headers=headers, timeout=30)
        assert res.status_code == 401 and "API key" in res.json()["error"]["message"]
    auth = {"Authorization": "Bearer k-123"}
    long = {**chat, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=long, headers=auth, timeout=60
    ) as held:
        lines = held.iter_lines()
        next(lines)  # the one admitted request is streaming now
        res = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=30)
        assert res.status_code == 429 and res.json()["error"]["message"]
    ok = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=60)
    assert ok.status_code == 200, ok.text
    r.proc.terminate()
    wait_all_kv_free(stack.prefill, stack.decode)


def test_router_without_workers_answers_503(tiny, redis_server, tmp_path):
    s = Stack(tiny, in_db(redis_server, 2), tmp_path)  # an empty registry
    try:
        r = s.router()
        url = f"http://127.0.0.1:{r.port}"
        wait_for(
            lambda: r.check_alive() or http_status(url + "/health") == 503,
            60,
            "the router to answer",
        )
        res = httpx.post(
            url + "/v1/chat/completions",
            json={"model": tiny.name, "messages": MESSAGES},
            timeout=30,
        )
        assert res.status_code == 503 and "prefill" in res.json()["error"]["message"]
    finally:
        s.stop()


def test_router_keeps_serving_its_workers_while_redis_is_down(tiny, private_redis, tmp_path):
    """Redis paused (SIGSTOP, as a hung or partitioned Redis): the router keeps routing to the
    workers it last saw and says the registry is down, and the workers pair for their first
    request without it; once Redis is back, a worker that deregisters leaves routing."""
    s = Stack(tiny, private_redis.url, tmp_path, ttl=2.0)
    try:
        prefill, decode = s.worker("prefill"), s.worker("decode")
        router = s.router()
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)

        def registry() -> dict:
            return httpx.get(url + "/health", timeout=10).json()["registry"]

        def ask(c: openai.OpenAI) -> None:
            res = c.chat.completions.create(
                model=tiny.name, messages=MESSAGES, max_tokens=4, temperature=0
            )
            assert res.choices[0].finish_reason == "length"

        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            # No request before the outage: the decode worker first pairs with the prefill
            # worker while Redis is down (it asks the prefill worker's Describe, not Redis).
            private_redis.pause()
            wait_for(lambda: registry()["up"] is False, 30, "the router to see Redis is down")
            # Well past one TTL without a refresh: the old router had forgotten every worker.
            wait_for(lambda: registry()["last_refresh_age_s"] > 2 * s.ttl, 30, "two TTLs")
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 200, health.text
            assert health.json()["workers"] == {"prefill": 1, "decode": 1}
            ask(c)
            metrics = httpx.get(url + "/metrics", timeout=10).text
            assert "\ndsaserve_router_registry_up 0.0\n" in metrics

            private_redis.resume()
            wait_for(lambda: registry()["up"], 30, "the router to reach Redis again")
            ask(c)
        decode.proc.terminate()  # a clean stop deletes the worker's registry record
        decode.proc.wait(timeout=30)
        wait_for(
            lambda: http_status(url + "/health") == 503, 10 * s.ttl, "the decode worker to leave"
        )
        message = httpx.get(url + "/health", timeout=10).json()["message"]
        assert "No live decode worker" in message
    finally:
        private_redis.resume()
        s.stop()


# ---------------------------------------------------------------- DeepSeek-V3.2's own (at the end:
# a module fixture is kept for one family at a time, and the stack above is V4's)


OSLO = [{"role": "user", "content": "What is the weather in Oslo?"}]


@families("deepseek_v32")
def test_dsaserve_up_serves_a_checkpoint(family, release, tmp_path):
    """`dsaserve up --model <the release checkpoint>`: its own Redis, a prefill and a decode
    worker, the router; chat answers are `dsaserve generate --chat`'s, through the
    prefill/decode path."""
    offline = offline_generate(release, OSLO, 16)
    thinking = offline_generate(release, OSLO, 16, "--thinking")
    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "dsaserve.services.cli", "up", "--model", str(release),
         "--port", str(port), "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "256", "--api-key", "unused"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert up.poll() is None, log.read_text()[-3000:]
            return http_status(url + "/health") == 200

        wait_for(healthy, START_TIMEOUT_S, "dsaserve up to report healthy")
        check_no_secret_on_a_command_line(up.pid)
        with openai_client(url) as c:
            res = c.chat.completions.create(
                model=release.name, messages=OSLO, max_tokens=16, temperature=0
            )
            assert res.choices[0].message.content == offline["message"]["content"]
            assert res.usage.completion_tokens == len(offline["token_ids"])
            # sent again: the prefill worker resumes from its prefix cache, the answer the same
            again = c.chat.completions.create(
                model=release.name, messages=OSLO, max_tokens=16, temperature=0
            )
            assert again.choices[0].message.content == offline["message"]["content"]
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert cached == again.usage.prompt_tokens - 1 > 0
            # thinking: the prompt opens <think>, the reply's reasoning goes to its own field
            stream = c.chat.completions.create(
                model=release.name, messages=OSLO, max_tokens=16, temperature=0, stream=True,
                extra_body={"chat_template_kwargs": {"thinking": True}},
            )  # fmt: skip
            reasoning = "".join(
                getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                for chunk in stream
                if chunk.choices
            )
            assert reasoning == thinking["message"]["reasoning_content"] != ""
            # a forced call: the reply is a V3.2 function_calls block under the tool's grammar
            # (bounded arguments: random weights never close a free string)
            res = c.chat.completions.create(
                model=release.name, messages=OSLO, max_tokens=200, temperature=0, tools=[FORECAST],
                tool_choice={"type": "function", "function": {"name": "forecast"}},
            )  # fmt: skip
            (call,) = res.choices[0].message.tool_calls
            assert call.function.name == "forecast"
            assert 1 <= json.loads(call.function.arguments)["days"] <= 7
        auth = {"Authorization": "Bearer unused"}
        rendered = httpx.post(
            url + "/tokenize", json={"model": release.name, "messages": OSLO}, headers=auth
        )
        assert rendered.status_code == 200, rendered.text
        ids = rendered.json()["tokens"]
        text = httpx.post(
            url + "/detokenize", json={"model": release.name, "tokens": ids}, headers=auth
        ).json()
        assert text["prompt"].endswith(
            "<｜User｜>What is the weather in Oslo?<｜Assistant｜></think>"
        )
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]


def check_no_secret_on_a_command_line(up_pid: int) -> None:
    """The children of `dsaserve up` (pid) get the API key, the cluster token and the Redis
    password from their environment: no command line shows them, and the Redis it started
    refuses a client without the password."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == up_pid:
                children.append(stat.parent)
    env: dict[str, str] = {}
    argvs = []
    for child in children:
        argv = (child / "cmdline").read_bytes().split(b"\0")
        argvs.append(argv)
        with contextlib.suppress(OSError):
            pairs = (e.split("=", 1) for e in (child / "environ").read_text().split("\0"))
            env.update(pair for pair in pairs if len(pair) == 2)
        if b"redis-server" in argv[0]:  # its title: "redis-server 127.0.0.1:PORT"
            redis_port = int(argv[0].rsplit(b":", 1)[1])
    password = env["DSASERVE_REDIS_URL"].split("@")[0].rsplit(":", 1)[1]
    secrets = {"unused", env["DSASERVE_CLUSTER_TOKEN"], password}
    assert all(len(secret) >= 6 for secret in secrets)
    assert not [a for argv in argvs for a in argv for secret in secrets if secret.encode() in a]
    assert len(children) == 4  # redis, prefill, decode, router
    with redis.Redis(port=redis_port, socket_timeout=5) as anonymous:
        with pytest.raises(redis.AuthenticationError):
            anonymous.keys("*")
    with redis.Redis.from_url(env["DSASERVE_REDIS_URL"], socket_timeout=5) as registry:
        assert registry.keys("dsaserve:worker:*")


@families("deepseek_v32")
def test_a_prefill_worker_and_a_decode_worker_of_another_family_refuse_to_pair(
    family, release, private_redis, tmp_path
):
    """A V3.2 prefill worker and a V4 decode worker, both serving a model of one name: the
    router finds no decode worker that shares the prefill worker's KV layout and says so; handed
    the V3.2 worker's KV, the V4 decode worker refuses it, naming both families; nothing is left
    held."""
    other = FAMILIES[DEFAULT_FAMILY]
    v4 = other.make_tiny_model(tmp_path / "v4" / release.name)
    s = Stack(release, private_redis.url, tmp_path)  # (no other worker in its registry)
    try:
        prefill = s.worker("prefill")
        decode = s.worker("decode", "--model", str(v4))
        router = s.router()
        s.wait_ready(prefill, decode)

        def seen_both() -> bool:  # the router's watcher has both records
            for p in s.procs:
                p.check_alive()
            r = httpx.get(f"http://127.0.0.1:{router.port}/health", timeout=5)
            return r.json().get("workers") == {"prefill": 1, "decode": 1}

        wait_for(seen_both, START_TIMEOUT_S, "the router to see both workers")
        health = httpx.get(f"http://127.0.0.1:{router.port}/health", timeout=5)
        assert health.status_code == 503, health.text
        assert "No decode worker shares a KV layout" in health.json()["message"], health.text
        body = {"model": release.name, "messages": OSLO, "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{router.port}/v1/chat/completions", json=body)
        assert r.status_code == 503 and "KV layout" in r.json()["error"]["message"], r.text

        sampling = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        metadata = token_metadata(TOKEN)
        prompt = list(range(3, 40))
        with grpc.insecure_channel(prefill.address) as channel:
            stub = grpc_api.PrefillStub(channel)
            request = pb.PrefillRequest(request_id="x", prompt_token_ids=prompt, sampling=sampling)
            held = stub.Prefill(request, metadata=metadata, timeout=60)
            with grpc.insecure_channel(decode.address) as to_decode:
                call = grpc_api.DecodeStub(to_decode).Decode(
                    pb.DecodeRequest(request_id="x", prompt_token_ids=prompt,
                                     first_token_id=held.first_token_id, sampling=sampling,
                                     kv=held.kv),
                    metadata=metadata, timeout=60,
                )  # fmt: skip
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
            stub.Release(pb.ReleaseRequest(request_id="x"), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert "KV layout mismatch" in details, details
        assert f"({family}," in details and f"({other}," in details, details
        for worker in (prefill, decode):
            wait_for(worker.all_kv_free, 30, f"{worker.name} to free every page and block")
    finally:
        s.stop()


# ---------------------------------------------------------------- DeepSeek-V4.1's own (after
# V3.2's: one family's module fixtures at a time)

ASCII = list(range(32, 127))  # one byte token a character: a reply's text is its tokens


@families("deepseek_v41")
def test_dsaserve_up_serves_a_v41_checkpoint(family, release, tmp_path):
    """`dsaserve up --model <a tiny V4.1 in the release's layout>`: the independent reference's
    greedy tokens through the prefill/decode path (gRPC, the KV pulled over NIXL: Engram's
    n-grams at the first decode step read the prompt's last tokens, which came with the
    request), a prompt sent again resumed from the prefill worker's prefix cache, chats rendered
    by DeepSeek's library as `dsaserve generate --chat` renders them, images refused."""
    reference = ReferenceV41(release)
    prompts = [byte_ids(n, 200 + n) for n in (7, 64, 150)]
    want = [bytes(reference.greedy(p, 12, ASCII)).decode() for p in prompts]
    offline = offline_generate(release, OSLO, 12, "--thinking")
    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "dsaserve.services.cli", "up", "--model", str(release),
         "--port", str(port), "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--api-key", "unused"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url, model = f"http://127.0.0.1:{port}", release.name
    try:

        def healthy() -> bool:
            assert up.poll() is None, log.read_text()[-3000:]
            return http_status(url + "/health") == 200

        wait_for(healthy, START_TIMEOUT_S, "dsaserve up to report healthy")
        with openai_client(url) as c:
            # token ids in, greedy among ASCII: prefilled in chunks of 64, decoded on the other
            # worker
            sampling = {"ignore_eos": True, "allowed_token_ids": ASCII}
            for prompt, text in zip(prompts, want, strict=True):
                res = c.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=sampling
                )
                assert res.choices[0].text == text
            # sent again: resumed from the prefill worker's checkpoint at its end
            again = c.completions.create(
                model=model, prompt=prompts[-1], max_tokens=12, temperature=0, extra_body=sampling
            )
            assert again.choices[0].text == want[-1]
            assert again.usage.prompt_tokens_details.cached_tokens == len(prompts[-1]) - 1
            # a chat: DeepSeek's library renders it, as `dsaserve generate --chat` does
            chat = c.chat.completions.create(
                model=model, messages=OSLO, max_tokens=12, temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": True}},
            )  # fmt: skip
            message = chat.choices[0].message
            assert (message.content or "") == offline["message"]["content"]
            assert (getattr(message, "reasoning_content", None) or "") == offline["message"].get(
                "reasoning_content", ""
            )
        auth = {"Authorization": "Bearer unused"}
        rendered = httpx.post(
            url + "/tokenize",
            json={"model": model, "messages": OSLO, "reasoning_effort": "max"},
            headers=auth,
        ).json()["tokens"]
        text = httpx.post(
            url + "/detokenize", json={"model": model, "tokens": rendered}, headers=auth
        ).json()["prompt"]
        library = V41Chat().render(OSLO, options=ChatOptions(thinking=True, reasoning_effort="max"))
        assert text == library and "Reasoning Effort: 100 " in text
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        refused = httpx.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": [image]}]},
            headers=auth,
        )
        assert refused.status_code == 400
        assert "vision tower is not loaded" in refused.json()["error"]["message"]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]


@families("deepseek_v41")
def test_v41_workers_export_engram_lookups_and_cache_hits(family, release, redis_url, tmp_path):
    with serving(StackSpec(), release, redis_url, tmp_path) as s:
        with openai_client(s.url) as c:
            for seed in range(3):
                c.completions.create(model=release.name, prompt=byte_ids(40, seed), max_tokens=4)
        for worker in (s.prefill, s.decode):
            lookups = worker.counter("dsaserve_engram_lookups_total")
            hits = worker.counter("dsaserve_engram_cache_hits_total")
            assert lookups > 0 and 0 <= hits <= lookups, (worker.name, lookups, hits)
