"""The prefill -> decode flow through the router, against scripted gRPC workers (no model).

`ScriptedWorker` (tests/scripted_worker.py) speaks the real wire contract (proto/dsaserve.proto)
from a script, so these tests pin the router's side: SSE format, usage, error mapping, retries,
and that every exit path cancels Decode and aborts the prefill. Chat replies (reasoning, tool
calls), logprobs and n are in test_router_chat.py; tests against real workers live elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from dsaserve.services.registry import WorkerRecord, seal, worker_key
from dsaserve.services.router.settings import RouterSettings
from dsaserve.services.router.tenancy import tenant_of
from dsaserve.services.rpc import pb
from tests.scripted_worker import MODEL, TOKEN, WAIT_S, Serve, sse_events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # 5 prompt tokens


async def wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), timeout=WAIT_S)


async def metric(router: Any, name: str) -> float:
    async with httpx.AsyncClient(base_url=router.url) as http:
        text = (await http.get("/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# ---------------------------------------------------------------- happy paths


@pytest.mark.asyncio
async def test_streamed_chat_follows_openai_sse(serve: Serve, make_router: Any) -> None:
    prefill = await serve("prefill", "p1")
    prefill.cached_tokens = 2  # the prefill worker's prefix cache held two prompt tokens
    await serve("decode", "d1")
    router = await make_router()
    body = CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    async with (
        httpx.AsyncClient(base_url=router.url) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(r)

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], MODEL, "chat.completion.chunk")
    }
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "He"},
        {"content": "llo"},
        {"content": " world"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [
        None,
        None,
        None,
        None,
        "stop",
    ]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},  # (no thinking)
    }


@pytest.mark.asyncio
async def test_openai_client_plain_and_streamed(serve: Serve, make_router: Any) -> None:
    await serve("prefill", "p1")
    await serve("decode", "d1")
    router = await make_router()
    client = router.openai()

    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.content == "Hello world"
    assert chat.choices[0].finish_reason == "stop"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (
        5,
        3,
        8,
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    text = await client.completions.create(model=MODEL, prompt="hi")
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == "Hello world"
    assert text.usage.prompt_tokens == 3  # bos + 2 bytes: a text prompt gets special tokens

    stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) async for c in stream]
    assert pieces == [("He", None), ("llo", None), (" world", None), ("", "stop")]


@pytest.mark.asyncio
async def test_request_fields_reach_the_workers(serve: Serve, make_router: Any) -> None:
    prefill = await serve("prefill", "p1")
    decode = await serve("decode", "d1")
    router = await make_router()
    body = CHAT | {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": -1,
        "stop": "\n",
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=router.url) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert (
            await http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 9, "top_k": -1})
        ).status_code == 200

    sent = prefill.prefill_requests[0]
    assert list(sent.prompt_token_ids) == [256, 258, ord("h"), ord("i"), 259]
    s = sent.sampling
    # A negative OpenAI seed lands in the worker's seed range [0, 2**63).
    assert (round(s.temperature, 3), round(s.top_p, 3), s.top_k, s.seed) == (0.5, 0.9, 7, 2**63 - 1)
    assert (list(s.stop), s.ignore_eos, s.max_tokens) == (
        ["\n"],
        True,
        64 - 5,
    )  # default: rest of the context
    later = prefill.prefill_requests[1].sampling
    assert (later.max_tokens, later.top_k, later.HasField("temperature")) == (9, 0, False)

    decoded = decode.decode_requests[0]
    assert decoded.request_id == sent.request_id and decoded.first_token_id == 72
    assert decoded.kv.layout_hash == "L1" and list(decoded.prompt_token_ids) == list(
        sent.prompt_token_ids
    )
    assert prefill.aborted == []


@pytest.mark.asyncio
@pytest.mark.parametrize("scope", [None, "global"])
async def test_each_key_prefills_in_a_cache_namespace_of_its_own(
    serve: Serve, make_router: Any, scope: str | None
) -> None:
    """By default (API keys: scope key) a request's cache_salt on the wire is its tenant, with
    vLLM's cache_salt after it; with --prefix-cache-scope global only the request's own salt."""
    prefill = await serve("prefill", "p1")
    await serve("decode", "d1")
    router = await make_router(api_keys=("key-a", "key-b"), prefix_cache_scope=scope)
    for key, salt in (("key-a", None), ("key-a", "s"), ("key-b", None), ("key-b", "s")):
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        await router.openai(key).chat.completions.create(**CHAT, **extra)
    sent = [
        r.sampling.cache_salt if r.sampling.HasField("cache_salt") else None
        for r in prefill.prefill_requests
    ]
    a, b = tenant_of("key-a"), tenant_of("key-b")
    assert sent == ([a, f"{a}:s", b, f"{b}:s"] if scope is None else [None, "s", None, "s"])


@pytest.mark.asyncio
async def test_an_answer_over_the_prompt_entries_limit_is_refused_before_any_prefill(
    serve: Serve, make_router: Any
) -> None:
    """echo + logprobs + prompt_logprobs over a batch of prompts: what the answer would carry is
    counted from the prompts' lengths before any work; at the limit it goes on to prefill."""
    prefill = await serve("prefill", "p1", prefill_finish=pb.FINISH_REASON_LENGTH)
    await serve("decode", "d1")
    router = await make_router(max_prompt_entries=600)
    body = {"model": MODEL, "prompt": ["abcdefghij"] * 3, "max_tokens": 1, "echo": True}
    async with httpx.AsyncClient(base_url=router.url) as http:
        # 2 x 3 prompts of 11 tokens (BOS + 10), each token 13: echo 1, logprobs 5 + 1, prompt 5 + 1
        over = await http.post(
            "/v1/completions", json=body | {"logprobs": 5, "prompt_logprobs": 5, "n": 2}
        )
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["code"] == "too_many_prompt_entries" and error["param"] == "prompt_logprobs"
        assert "858 entries" in error["message"] and "--max-prompt-entries" in error["message"]
        assert prefill.prefill_requests == []
        at = await http.post("/v1/completions", json=body | {"logprobs": 5, "prompt_logprobs": 5})
        # 429 entries: on to the prefill worker (this scripted one sends no prompt logprobs,
        # which is an error the router finds before its answer goes out)
        assert at.status_code == 500 and at.json()["error"]["type"] == "server_error"
        assert len(prefill.prefill_requests) == 3


@pytest.mark.asyncio
async def test_prefill_that_finishes_skips_decode(serve: Serve, make_router: Any) -> None:
    prefill = await serve("prefill", "p1", first_text="X", prefill_finish=pb.FINISH_REASON_LENGTH)
    decode = await serve("decode", "d1")
    router = await make_router()
    client = router.openai()
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("X", "length")
    assert decode.decode_requests == [] and prefill.aborted == []


# ---------------------------------------------------------------- failures


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.FAILED_PRECONDITION, 500),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
async def test_prefill_grpc_status_maps_to_http(
    serve: Serve, make_router: Any, code: grpc.StatusCode, status: int
) -> None:
    await serve("prefill", "p1", prefill_status=code)
    await serve("decode", "d1")
    router = await make_router()
    async with httpx.AsyncClient(base_url=router.url) as http:
        response = await http.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == status
    error = response.json()["error"]
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert f"scripted {code.name}" in error["message"]  # the worker's words on the request
    else:  # which worker, and what it said about the cluster, go to the log only
        assert "scripted" not in error["message"] and "127.0.0.1" not in error["message"]


@pytest.mark.asyncio
async def test_wrong_cluster_token_is_explained(
    serve: Serve, start_router: Any, router_model_dir: Path, redis_url: str
) -> None:
    await serve("prefill", "p1")
    await serve("decode", "d1")
    router = await start_router(
        RouterSettings(str(router_model_dir), redis_url, cluster_token="wrong")
    )
    await router.refresh_registry()
    async with httpx.AsyncClient(base_url=router.url) as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    # The workers' records are signed with another token: the router trusts none of them.
    assert response.status_code == 503 and "--cluster-token" in response.json()["error"]["message"]


@pytest.mark.asyncio
async def test_a_rogue_registry_record_receives_nothing(
    serve: Serve, make_router: Any, redis_url: str
) -> None:
    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    rogue = await asyncio.start_server(count, "127.0.0.1", 0)
    address = f"127.0.0.1:{rogue.sockets[0].getsockname()[1]}"
    await serve("prefill", "p1", load=5)
    await serve("decode", "d1", load=5)
    # Idle-looking rogues of both roles, as any local user can write them into Redis: unsigned,
    # signed with a guessed token, and a real worker's signed record with the address swapped.
    real = WorkerRecord("rogue", "prefill", address, MODEL, "L1", "agent")  # type: ignore[arg-type]
    elsewhere = dataclasses.replace(real, worker_id="p1x", address="127.0.0.1:1")
    swapped = json.loads(seal(elsewhere, TOKEN, time.time()))
    swapped["record"]["address"] = address
    planted = {
        "rogue": real.to_json(),
        "rogue-d": seal(
            dataclasses.replace(real, worker_id="rogue-d", role="decode"), "guess", time.time()
        ),
        "p1x": json.dumps(swapped),
    }
    registry = aioredis.Redis.from_url(redis_url)
    for worker_id, value in planted.items():
        await registry.set(worker_key(worker_id), value, px=60_000)
    await registry.aclose()
    router = await make_router(policy="least_load")
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
            for _ in range(6):
                response = await http.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["message"]["content"] == "Hello world"
            health = (await http.get("/health")).json()
        assert health["workers"] == {"prefill": 1, "decode": 1}
        assert connections == 0
    finally:
        rogue.close()
        await rogue.wait_closed()


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_unavailable_worker_is_retried_on_another(
    serve: Serve, make_router: Any, unused_tcp_port: int, role: str
) -> None:
    # least_load tries the idle-looking dead worker first; nothing listens on its port.
    await serve(role, "dead", load=0, address=f"127.0.0.1:{unused_tcp_port}")
    live = await serve(role, "live", load=5)
    other = await serve("decode" if role == "prefill" else "prefill", "other")
    router = await make_router()
    async with httpx.AsyncClient(base_url=router.url) as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"
    requests = live.prefill_requests if role == "prefill" else live.decode_requests
    assert len(requests) == 1
    assert live.aborted == [] and other.aborted == []


@pytest.mark.asyncio
async def test_only_unavailable_workers_is_503(
    serve: Serve, make_router: Any, unused_tcp_port: int
) -> None:
    await serve("prefill", "dead", address=f"127.0.0.1:{unused_tcp_port}")
    await serve("decode", "d1")
    router = await make_router()
    async with httpx.AsyncClient(base_url=router.url) as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert f"127.0.0.1:{unused_tcp_port}" not in response.json()["error"]["message"]  # (logged)


@pytest.mark.asyncio
async def test_decode_error_after_streaming_began(serve: Serve, make_router: Any) -> None:
    prefill = await serve("prefill", "p1")
    await serve("decode", "d1", decode_error="NIXL read failed")
    router = await make_router()
    async with (
        httpx.AsyncClient(base_url=router.url) as http,
        http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as r,
    ):
        assert r.status_code == 200
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    # A failed KV pull is retryable: the error says so with its type (503s are)
    assert "retried" in error["message"] and "NIXL read failed" not in error["message"]
    assert error["type"] == "service_unavailable_error"
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-2]] == [
        "He",
        "llo",
        " world",
    ]
    await wait_for(prefill.abort_seen)  # the KV may still be pinned on the prefill side
    assert prefill.aborted == [events[0]["id"]]
    assert await metric(router, 'dsaserve_router_failures_total{cause="transfer"}') == 1


@pytest.mark.asyncio
async def test_stream_disconnect_cancels_decode_and_aborts_prefill(
    serve: Serve, make_router: Any
) -> None:
    hold = asyncio.Event()
    prefill = await serve("prefill", "p1")
    decode = await serve("decode", "d1", hold_decode=hold)
    router = await make_router()
    try:
        async with (
            httpx.AsyncClient(base_url=router.url) as http,
            http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as r,
        ):
            lines = r.aiter_lines()
            while "world" not in await asyncio.wait_for(anext(lines), WAIT_S):
                pass
        # Leaving the block closed the connection mid-stream.
        await wait_for(decode.decode_cancelled)
        await wait_for(prefill.abort_seen)
        assert prefill.aborted == [decode.decode_requests[0].request_id]
        await wait_metric_zero(router, "dsaserve_router_inflight_requests")
        assert (
            await metric(router, 'dsaserve_router_failures_total{cause="client_disconnect"}') == 1
        )
    finally:
        hold.set()


@pytest.mark.asyncio
async def test_non_streaming_disconnect_cancels_decode(serve: Serve, make_router: Any) -> None:
    hold = asyncio.Event()
    prefill = await serve("prefill", "p1")
    decode = await serve("decode", "d1", hold_decode=hold)
    router = await make_router()
    try:
        async with httpx.AsyncClient(base_url=router.url) as http:
            request = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
            deadline = time.monotonic() + WAIT_S
            while not decode.decode_requests:
                assert not request.done(), request.result()
                assert time.monotonic() < deadline, "Decode was never called"
                await asyncio.sleep(0.01)  # polling for the decode call to start
            request.cancel()  # the client gives up: httpx closes the connection
        await wait_for(decode.decode_cancelled)
        await wait_for(prefill.abort_seen)
        await wait_metric_zero(router, "dsaserve_router_inflight_requests")
    finally:
        hold.set()


@pytest.mark.asyncio
async def test_request_timeout_is_504(serve: Serve, make_router: Any) -> None:
    hold = asyncio.Event()
    await serve("prefill", "p1")
    decode = await serve("decode", "d1", hold_decode=hold)
    router = await make_router(request_timeout_s=1.0)
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
            response = await http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]
        await wait_for(decode.decode_cancelled)
    finally:
        hold.set()


@pytest.mark.asyncio
async def test_full_admission_queue_is_429(serve: Serve, make_router: Any) -> None:
    hold = asyncio.Event()
    await serve("prefill", "p1")
    await serve("decode", "d1", hold_decode=hold)
    router = await make_router(max_inflight=1, max_queue=0)
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json=CHAT | {"stream": True}
        ) as first:
            assert first.status_code == 200  # headers are out: it holds the only slot
            second = await http.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 429 and second.json()["error"]["code"] == "queue_full"
            assert second.headers["retry-after"] == "1"
            # Refused before it is rendered and tokenized (it costs the router nothing): a
            # prompt over the context gets the 429, not the 400 its tokens would earn.
            too_long = {"messages": [{"role": "user", "content": "word " * 2_000}]}
            refused = await http.post("/v1/chat/completions", json=CHAT | too_long)
            assert refused.status_code == 429, refused.text
            hold.set()
            assert (await sse_events(first))[-1] == "[DONE]"
        too_long_now = await http.post("/v1/chat/completions", json=CHAT | too_long)
        assert too_long_now.status_code == 400  # (the slot is free: it is tokenized, and refused)
        third = await http.post("/v1/chat/completions", json=CHAT)  # the slot is free again
        assert third.status_code == 200


@pytest.mark.asyncio
async def test_a_request_waits_for_admission_at_most_the_queue_delay(
    serve: Serve, make_router: Any
) -> None:
    hold = asyncio.Event()
    await serve("prefill", "p1")
    await serve("decode", "d1", hold_decode=hold)
    router = await make_router(max_inflight=1, max_queue=4, max_queue_delay_s=0.5)
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=CHAT | {"stream": True}
            ) as first:
                assert first.status_code == 200  # it holds the only slot
                waited = await http.post("/v1/chat/completions", json=CHAT)
                assert waited.status_code == 503, waited.text  # refused, not left to hang
                assert waited.json()["error"]["code"] == "queue_timeout"
                assert waited.headers["retry-after"] == "1"
                hold.set()
                assert (await sse_events(first))[-1] == "[DONE]"
        finally:
            hold.set()
    assert await metric(router, "dsaserve_router_queue_depth") == 0


async def wait_metric_zero(router: Any, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while await metric(router, name) != 0:
        assert time.monotonic() < deadline, f"{name} did not return to 0"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_max_inflight_per_key_is_429_for_that_key_only(
    serve: Serve, make_router: Any
) -> None:
    hold = asyncio.Event()
    await serve("prefill", "p1")
    await serve("decode", "d1", hold_decode=hold)
    router = await make_router(api_keys=("k1", "k2"), max_inflight_per_key=1)
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    streaming = CHAT | {"stream": True}
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=streaming, headers=k1
            ) as first:
                assert first.status_code == 200  # k1's one request is in flight
                second = await http.post("/v1/chat/completions", json=CHAT, headers=k1)
                assert second.status_code == 429, second.text
                assert second.json()["error"]["code"] == "too_many_requests_per_key"
                assert second.headers["retry-after"] == "1"
                async with http.stream(
                    "POST", "/v1/chat/completions", json=streaming, headers=k2
                ) as other_key:
                    assert other_key.status_code == 200
                    hold.set()
                    assert (await sse_events(other_key))[-1] == "[DONE]"
                assert (await sse_events(first))[-1] == "[DONE]"
        finally:
            hold.set()
        again = await http.post("/v1/chat/completions", json=CHAT, headers=k1)
        assert again.status_code == 200, again.text  # the key's slot was given back
    assert await metric(router, 'dsaserve_router_failures_total{cause="key_limit"}') == 1


@pytest.mark.asyncio
async def test_by_default_one_key_cannot_also_take_the_queue(
    serve: Serve, make_router: Any
) -> None:
    hold = asyncio.Event()
    await serve("prefill", "p1")
    await serve("decode", "d1", hold_decode=hold)
    router = await make_router(api_keys=("k1", "k2"), max_inflight=1)  # no per-key flag
    k1, k2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=CHAT | {"stream": True}, headers=k1
            ) as first:
                assert first.status_code == 200  # k1 holds the only slot
                second = await http.post("/v1/chat/completions", json=CHAT, headers=k1)
                assert second.json()["error"]["code"] == "too_many_requests_per_key"
                queued = asyncio.ensure_future(
                    http.post("/v1/chat/completions", json=CHAT, headers=k2)
                )
                hold.set()
                assert (await sse_events(first))[-1] == "[DONE]"
            assert (await queued).status_code == 200  # k2 waited in the queue, and was served
        finally:
            hold.set()


@pytest.mark.asyncio
async def test_line_separators_in_text_stay_inside_their_sse_event(
    serve: Serve, make_router: Any
) -> None:
    # Characters str.splitlines() breaks at, which JSON may leave raw: httpx's aiter_lines()
    # (used by sse_events) would split an event there and fail to parse it.
    breaks = [chr(i) for i in range(0x110000) if len(f"a{chr(i)}b".splitlines()) > 1]
    text = "".join(f"{c}x" for c in breaks)
    await serve("prefill", "p1", first_text="He")
    await serve("decode", "d1", chunks=(text, "end"))
    router = await make_router()
    async with (
        httpx.AsyncClient(base_url=router.url) as http,
        http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r,
    ):
        events = await sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "He" + text + "end"


@pytest.mark.asyncio
async def test_unhealthy_worker_is_skipped_while_another_can_serve(
    serve: Serve, make_router: Any
) -> None:
    await serve("prefill", "p1")
    benched = await serve("decode", "d1")
    healthy = await serve("decode", "d2")
    router = await make_router(policy="round_robin")
    selector = router.app.state.router.selector
    selector.mark_unhealthy("d1", 600, "stalled")
    async with httpx.AsyncClient(base_url=router.url) as http:
        for _ in range(4):  # round robin would give d1 every other request
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        health = (await http.get("/health")).json()
        assert health["unhealthy_workers"] == {"prefill": 0, "decode": 1}
        assert (len(benched.decode_requests), len(healthy.decode_requests)) == (0, 4)
        assert (
            await metric(
                router,
                'dsaserve_router_workers_marked_unhealthy_total{reason="stalled",role="decode"}',
            )
            == 1
        )
        assert await metric(router, 'dsaserve_router_unhealthy_workers{role="decode"}') == 1

        # Every candidate benched: they are tried anyway rather than refusing for sure.
        selector.mark_unhealthy("d2", 600, "stalled")
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        # A cool-down that is over excludes nothing any more (0 s: over at once).
        selector.mark_unhealthy("p1", 0, "unavailable")
        assert selector.unhealthy("prefill") == []
        selector.mark_unhealthy("gone", 600, "stalled")  # not in the registry: ignored
    assert len(benched.decode_requests) + len(healthy.decode_requests) == 5


@pytest.mark.asyncio
async def test_a_stalled_decode_stream_is_abandoned_and_its_worker_skipped(
    serve: Serve, make_router: Any, redis_url: str
) -> None:
    """A decode worker whose stream goes silent (alive, engine stuck): the stream ends with an
    error after the stall timeout, the call is cancelled, and new requests go elsewhere."""
    await serve("prefill", "p1")
    stuck = await serve("decode", "d1", hold_decode=asyncio.Event())
    router = await make_router(stall_timeout_s=0.5)
    async with httpx.AsyncClient(base_url=router.url, timeout=WAIT_S) as http:
        async with http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
            events = await sse_events(r)
        error = events[-2]["error"]
        assert "sent nothing for 0.5 s" in error["message"]
        assert error["type"] == "service_unavailable_error"
        await asyncio.wait_for(stuck.decode_cancelled.wait(), WAIT_S)
        await serve("decode", "d2")
        await router.refresh_registry()
        health = (await http.get("/health")).json()
        assert health["unhealthy_workers"] == {"prefill": 0, "decode": 1}
        ok = await http.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert await metric(router, 'dsaserve_router_failures_total{cause="stalled"}') == 1
