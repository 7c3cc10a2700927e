"""DeepSeek-V3.2 through the whole stack, as real processes: `dsaserve up` serving a tiny V3.2
checkpoint (the release's chat encoder: thinking into reasoning_content, DSML function_calls into
tool_calls, /tokenize; a prompt sent again resumed from the prefix cache), and a V3.2 prefill
worker that a V4 decode worker refuses to pair with."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model as make_v4
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model
from dsaserve.services.auth import token_metadata
from dsaserve.services.rpc import grpc_api, pb
from tests.conftest import free_port
from tests.serving_stack import (
    FORECAST,
    START_TIMEOUT_S,
    TOKEN,
    Stack,
    http_status,
    offline_generate,
    openai_client,
    wait_for,
)

pytestmark = pytest.mark.e2e  # the stack's processes

MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("v32") / "tiny", fmt="release")


def test_dsaserve_up_serves_a_v32_checkpoint(model, tmp_path):
    """`dsaserve up --model <V3.2>`: its own Redis, a prefill and a decode worker, the router;
    chat answers are `dsaserve generate --chat`'s, through the prefill/decode path."""
    offline = offline_generate(model, MESSAGES, 16)
    thinking = offline_generate(model, MESSAGES, 16, "--thinking")
    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "dsaserve.services.cli", "up", "--model", str(model),
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
                model="tiny", messages=MESSAGES, max_tokens=16, temperature=0
            )
            assert res.choices[0].message.content == offline["message"]["content"]
            assert res.usage.completion_tokens == len(offline["token_ids"])
            # sent again: the prefill worker resumes from its prefix cache, the answer the same
            again = c.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=16, temperature=0
            )
            assert again.choices[0].message.content == offline["message"]["content"]
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert cached == again.usage.prompt_tokens - 1 > 0
            # thinking: the prompt opens <think>, the reply's reasoning goes to its own field
            stream = c.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
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
                model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, tools=[FORECAST],
                tool_choice={"type": "function", "function": {"name": "forecast"}},
            )  # fmt: skip
            (call,) = res.choices[0].message.tool_calls
            assert call.function.name == "forecast"
            assert 1 <= json.loads(call.function.arguments)["days"] <= 7
        auth = {"Authorization": "Bearer unused"}
        rendered = httpx.post(
            url + "/tokenize", json={"model": "tiny", "messages": MESSAGES}, headers=auth
        )
        assert rendered.status_code == 200, rendered.text
        ids = rendered.json()["tokens"]
        text = httpx.post(
            url + "/detokenize", json={"model": "tiny", "tokens": ids}, headers=auth
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


def test_a_v32_prefill_worker_and_a_v4_decode_worker_refuse_to_pair(model, redis_url, tmp_path):
    """Both serve a model named `tiny`: the router finds no decode worker that shares the V3.2
    prefill worker's KV layout and says so; handed the V3.2 worker's KV, the V4 decode worker
    refuses it, naming both families; nothing is left held."""
    v4 = make_v4(tmp_path / "v4" / "tiny")
    s = Stack(model, redis_url, tmp_path)
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
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
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
        assert "(deepseek_v32," in details and "(deepseek_v4," in details, details
        for worker in (prefill, decode):
            wait_for(worker.all_kv_free, 30, f"{worker.name} to free every page and block")
    finally:
        s.stop()
