"""Issue 33's adversary against `dsaserve up` with two API keys (one stack for the module, its
registry in the test's Redis): one key cannot read another's stored responses nor learn from the
prefix cache what it sent; hostile schemas, a logprobs bomb and a huge header are refused at
once while another key's stream flows; a poisoned registry key is ignored; a frozen decode
worker leaves routing.

Timings are measured and printed (`-s` shows them), never asserted tightly: each wait is only
bounded generously, so a loaded CI machine fails nothing that works.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from dsaserve.engine.ports import free_port
from tests.serving_stack import START_TIMEOUT_S, http_status, wait_for

pytestmark = pytest.mark.e2e  # the stack's processes

KEYS = ("key-a", "key-b")
DB = 11  # the stack's registry: a database of the session's Redis of its own
LONG = ("Who is it that knocks so late? " * 40)[:1000]  # 1,000 tokens (the demo's are bytes)


@dataclass
class Up:
    url: str
    proc: subprocess.Popen[bytes]
    redis: redis.Redis
    log: Path

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def child(self, role: str) -> int:
        """The pid of the stack's `role` process."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and role.encode() in cmdline:
                return int(pid)
        raise AssertionError(f"no {role} process under dsaserve up")


@pytest.fixture(scope="module")
def up(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{DB}"
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    client.flushdb()
    port = free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    argv = [sys.executable, "-m", "dsaserve.services.cli", "up", "--port", str(port)]
    argv += ["--redis-url", redis_url, *(a for key in KEYS for a in ("--api-key", key))]
    proc = subprocess.Popen(
        argv,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stack = Up(f"http://127.0.0.1:{port}", proc, client, log)
    try:

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return http_status(stack.url + "/health") == 200

        wait_for(healthy, START_TIMEOUT_S, "dsaserve up to report healthy")
        yield stack
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        client.flushdb()
        client.close()


def measured(name: str, **figures: object) -> None:
    print(f"\n[measured] {name}: {json.dumps(figures)}")


def test_a_stored_response_is_its_own_keys(up: Up) -> None:
    a, b = up.client("key-a"), up.client("key-b")
    first = a.responses.create(input="Who goes there?", max_output_tokens=8)
    for attempt in (
        lambda: b.responses.retrieve(first.id),
        lambda: b.responses.create(input="And then?", previous_response_id=first.id),
        lambda: b.responses.input_items.list(first.id),
        lambda: b.responses.delete(first.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    continued = a.responses.create(
        input="And then?", previous_response_id=first.id, max_output_tokens=8
    )
    assert continued.usage.input_tokens > first.usage.input_tokens  # (it carries the first)
    assert [i.type for i in a.responses.input_items.list(first.id)] == ["message"]
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def _first_token(client: openai.OpenAI, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens) of one chat."""
    start, first = time.monotonic(), None
    cached = -1
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        model="dsaserve-demo-v4",
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.monotonic() - start
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    assert first is not None
    return first, cached


def test_a_prompt_hits_only_its_own_keys_cache(up: Up) -> None:
    """Key B sending key A's long prompt computes it all (cached_tokens 0, the first token as
    late as a miss); A sending it again resumes; vLLM's cache_salt partitions further."""
    a, b = up.client("key-a"), up.client("key-b")
    miss_a, cached = _first_token(a, LONG)
    assert cached == 0
    hit_a, cached_again = _first_token(a, LONG)
    assert cached_again >= 512  # (from the checkpoint every 512 tokens, at least)
    miss_b, cached_b = _first_token(b, LONG)
    assert cached_b == 0
    salted = b.chat.completions.create(
        messages=[{"role": "user", "content": LONG}],
        max_tokens=1,
        model="dsaserve-demo-v4",
        extra_body={"cache_salt": "a-secret-of-b"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    measured("time to first token, s", miss_a=miss_a, hit_a=hit_a, other_key_same_prompt=miss_b)


STREAM_TOKENS = 200
PATTERNS = {f"^p{i}[a-z]+$": {"type": "integer"} for i in range(400)}  # ~30 s to compile
HOSTILE = {
    "self $ref": ({"$ref": "#"}, "no finite instance"),
    "mutual $ref": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "no finite instance",
    ),
    "required self": (
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        "no finite instance",
    ),
    "over budget": (
        {"type": "object", "patternProperties": PATTERNS},
        "--grammar-compile-timeout",
    ),
}


def test_hostile_schemas_are_refused_while_another_keys_stream_flows(up: Up) -> None:
    """Each hostile schema is a 400 naming why; a stream of key A meanwhile keeps its pace
    (its longest pause between tokens while they are refused is measured)."""
    arrivals: list[float] = []
    ended = threading.Event()

    def stream() -> None:
        with up.client("key-a") as a:
            chunks = a.chat.completions.create(
                messages=[{"role": "user", "content": "Speak."}],
                max_tokens=STREAM_TOKENS,
                stream=True,
                model="dsaserve-demo-v4",
                extra_body={"ignore_eos": True},
            )
            for _ in chunks:
                arrivals.append(time.monotonic())
        ended.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for(lambda: len(arrivals) > 10, 120, "the stream to flow")
    window_start = time.monotonic()
    took = {}
    with up.client("key-b") as b:
        for name, (schema, says) in HOSTILE.items():
            start = time.monotonic()
            with pytest.raises(openai.BadRequestError, match=says):
                b.chat.completions.create(
                    messages=[{"role": "user", "content": "JSON, please."}],
                    max_tokens=8,
                    model="dsaserve-demo-v4",
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "h", "schema": schema, "strict": True},
                    },
                )
            took[name] = round(time.monotonic() - start, 3)
    window_end = time.monotonic()
    assert not ended.is_set(), "the stream ended before the hostile requests did: lengthen it"
    streaming.join(timeout=300)
    assert ended.is_set()
    during = [t for t in arrivals if window_start <= t <= window_end]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    measured(
        "hostile schemas",
        seconds_to_400=took,
        stream_longest_pause_s=round(max(gaps, default=0.0), 3),
        stream_tokens_meanwhile=len(during),
    )
    assert len(during) > 1  # (it went on while they were refused)


def test_the_logprobs_bomb_is_refused_before_any_work(up: Up) -> None:
    prompts = [LONG] * 16
    start = time.monotonic()
    response = httpx.post(
        up.url + "/v1/completions",
        json={
            "prompt": prompts,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 20,
            "prompt_logprobs": 20,
        },
        headers={"Authorization": "Bearer key-a"},
        timeout=120,
    )
    took = time.monotonic() - start
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "too_many_prompt_entries" and "--max-prompt-entries" in error["message"]
    measured("logprobs bomb", seconds_to_400=round(took, 3), answer_bytes=len(response.content))


def test_a_one_mib_header_is_431(up: Up) -> None:
    host, port = up.url.removeprefix("http://").split(":")
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        try:
            conn.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # (refused before it was all sent: the answer is waiting)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_a_poisoned_registry_key_is_ignored_and_the_watcher_lives(up: Up) -> None:
    up.redis.set("dsaserve:worker:poison", b"[" * 200_000 + b"]" * 200_000)
    try:
        wait_for(lambda: up.health()["registry"]["ignored_entries"] >= 1, 60, "the refresh")
        registry = up.health()["registry"]
        assert registry["watcher_restarts"] == 0 and registry["up"] is True
        with up.client("key-a") as a:
            answer = a.chat.completions.create(
                messages=[{"role": "user", "content": "Still there?"}],
                max_tokens=4,
                model="dsaserve-demo-v4",
            )
        assert answer.choices[0].finish_reason in ("length", "stop")
    finally:
        up.redis.delete("dsaserve:worker:poison")


def test_a_frozen_decode_worker_leaves_routing_within_the_heartbeat_timeout(up: Up) -> None:
    """SIGSTOP: the worker neither dies nor deregisters; its record expires (TTL 6 s) and the
    next refresh (every 3 s) drops it. Last in the module: it disturbs the stack."""
    decode = up.child("decode")
    assert up.health()["workers"]["decode"] == 1
    os.kill(decode, signal.SIGSTOP)
    start = time.monotonic()
    try:
        wait_for(lambda: up.health()["workers"]["decode"] == 0, 60, "the frozen worker to leave")
        took = time.monotonic() - start
    finally:
        os.kill(decode, signal.SIGCONT)
    wait_for(lambda: up.health()["workers"]["decode"] == 1, 60, "the worker to come back")
    measured("frozen decode worker out of routing", seconds=round(took, 2))
