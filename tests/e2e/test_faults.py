"""Faults against the real stack (redis-server, workers and router as processes, NIXL, gRPC):
nothing is served from freed pages, nothing leaks, nothing hangs.

Each test breaks a stack of its own, in a Redis database of its own.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest
import redis

from dsaserve.services.auth import token_metadata
from dsaserve.services.registry import unseal, worker_key
from dsaserve.services.rpc import grpc_api, pb
from tests.serving_stack import (
    TOKEN,
    Proc,
    Stack,
    in_db,
    slow_profile,
    wait_all_kv_free,
    wait_for,
    wait_for_a_refresh,
)

pytestmark = pytest.mark.e2e  # the stack as processes, broken on purpose

PROMPTS = [f"Tell me about river number {i}, please." for i in range(6)]


def stack_in_db(model, redis_server: str, tmp_path, db: int) -> Stack:
    url = in_db(redis_server, db)
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
    return Stack(model, url, tmp_path, ttl=3.0)


def chat(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12}
    body |= {"temperature": 0, "ignore_eos": True} | extra
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_decode_stopped_past_the_lease_never_answers_from_freed_pages(tiny, redis_server, tmp_path):
    """The decode worker is stopped (SIGSTOP) while requests arrive; their prefill leases run out
    and their pages go to the next requests. Once it resumes, every request is answered exactly
    as before the fault or refused with a clear error: no answer from someone else's KV."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=3)
    try:
        prefill = s.worker("prefill", "--lease-seconds", "1")
        # (a decode worker that kept the reference turns would be asked to lend them to the
        # prefill worker, and a stopped one answers no Lend: each prefill would first wait out
        # the call, ~8 s, which the decode stream's own keepalive does not outlast)
        decode = s.worker("decode", "--no-enable-prefix-caching")
        router = s.router()
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        reference = {p: answer(chat(url, p)) for p in PROMPTS}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            decode.proc.send_signal(signal.SIGSTOP)
            try:
                futures = {p: pool.submit(chat, url, p) for p in PROMPTS}
                # Every request prefilled, then its lease ran out and its pages were freed;
                # the later prefills took pages the earlier ones had held.
                wait_for(
                    lambda: prefill.failures("lease_expired") >= len(PROMPTS),
                    60,
                    "the held requests' leases to run out",
                )
            finally:
                decode.proc.send_signal(signal.SIGCONT)
            results = {p: f.result() for p, f in futures.items()}
        refused = 0
        for prompt, response in results.items():
            if response.status_code == 200:
                assert answer(response) == reference[prompt], "an answer from freed pages"
            else:
                refused += 1
                error = response.json()["error"]
                assert response.status_code == 503, response.text
                assert "lease" in error["message"] and "retried" in error["message"]
        assert refused > 0, "no request met an expired lease: the fault did not happen"
        assert decode.failures("lease_expired") == refused
        wait_all_kv_free(prefill, decode, timeout=30)
        # Stopped past its registry TTL, the decode worker's record expired: it re-registers on
        # resuming, and the router sees it a heartbeat later (0.7 s here), not at once.
        s.wait_healthy(router, prefill=1, decode=1)
        assert answer(chat(url, PROMPTS[0])) == reference[PROMPTS[0]]  # and it serves again
    finally:
        s.stop()


def test_an_abort_under_load_is_answered_at_once_and_frees_the_pages(tiny, redis_server, tmp_path):
    """The router's Abort has a short deadline; the prefill worker answers it from its lease
    table while its engine is busy, and the engine frees the pages at its next drain (the lease
    here is far longer than the test). Steps of 4096 rows keep the engine busy for a second or
    more each (prompts that share nothing: the prefix cache would compute one of them only)."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=4)
    try:
        prefill = s.worker("prefill", "--lease-seconds", "600", "--max-num-batched-tokens", "4096")
        s.wait_ready(prefill)
        with grpc.insecure_channel(prefill.address) as channel:
            stub, metadata = grpc_api.PrefillStub(channel), token_metadata(TOKEN)
            sampling = pb.SamplingParams(max_tokens=4, temperature=0)
            held = pb.PrefillRequest(
                request_id="held", prompt_token_ids=[1] * 30, sampling=sampling
            )
            assert stub.Prefill(held, metadata=metadata, timeout=60).HasField("kv")
            busy = [
                stub.Prefill.future(
                    pb.PrefillRequest(
                        request_id=f"busy-{i}", prompt_token_ids=[2 + i] * 4000, sampling=sampling
                    ),
                    metadata=metadata,
                    timeout=120,
                )
                for i in range(3)
            ]
            wait_for(lambda: prefill.load().running > 0, 60, "the long prefills to start")
            aborted = stub.Abort(pb.AbortRequest(request_id="held"), metadata=metadata, timeout=0.2)
            assert aborted.found
            for future in busy:
                future.result()
            for i in range(3):  # nobody reads these: free them
                stub.Release(pb.ReleaseRequest(request_id=f"busy-{i}"), metadata=metadata)
            with pytest.raises(grpc.RpcError) as gone:
                stub.Claim(pb.ClaimRequest(request_id="held", hold_ms=1000), metadata=metadata)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        wait_for(prefill.all_kv_free, 30, "the aborted request's pages to be free")
    finally:
        s.stop()


def test_a_prefill_worker_restarted_under_the_same_id_serves_at_once(tiny, redis_server, tmp_path):
    """Killed with -9 and restarted with the same --worker-id and address (as a container
    restart does): the decode worker must not reuse its connection to the dead NIXL agent."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=5)
    try:
        prefill = s.worker("prefill", "--worker-id", "prefill-a")
        decode = s.worker("decode")
        router = s.router()
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        before = answer(chat(url, PROMPTS[1]))
        s.kill(prefill)
        again = _restart_in_place(s, prefill)
        s.wait_ready(again)
        s.wait_healthy(router)
        for _ in range(3):
            assert answer(chat(url, PROMPTS[1])) == before
        wait_all_kv_free(again, decode, timeout=30)
    finally:
        s.stop()


def test_a_restarted_prefill_worker_pairs_with_decode_while_redis_is_down(
    tiny, private_redis, tmp_path
):
    """Redis is discovery only. A prefill worker restarted under the same id and address runs a
    new NIXL agent; Redis then stops (SIGSTOP) before any request reaches it. The router keeps
    routing to the address it last saw, and the decode worker loads the new agent from the prefill
    worker's Describe over gRPC: answers as before. A KV handle of the dead process is refused
    with a clear, retryable cause."""
    s = Stack(tiny, private_redis.url, tmp_path, ttl=2.0)
    try:
        prefill = s.worker("prefill", "--worker-id", "prefill-a")
        decode = s.worker("decode")
        router = s.router()
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        before = answer(chat(url, PROMPTS[2]))  # the decode worker loads the first agent
        stale = _prefill_directly(prefill, "held-by-the-dead-process")
        s.kill(prefill)
        again = _restart_in_place(s, prefill)
        s.wait_ready(again)  # registered: Redis is still up here

        def registry() -> dict:
            return httpx.get(url + "/health", timeout=10).json()["registry"]

        def routed() -> dict:
            return httpx.get(url + "/health", timeout=10).json()["workers"]

        # The dead worker's record may have expired during the restart: the router must have
        # read the new one before Redis stops.
        wait_for(lambda: routed()["prefill"] == 1, 30, "the router to see the restarted worker")
        private_redis.pause()

        wait_for(lambda: registry()["up"] is False, 30, "the router to see Redis is down")
        # Past every record's TTL: without its snapshot the router would route nowhere.
        wait_for(lambda: registry()["last_refresh_age_s"] > 2 * s.ttl, 30, "two TTLs")
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["workers"] == {"prefill": 1, "decode": 1}, health

        for _ in range(2):
            assert answer(chat(url, PROMPTS[2])) == before
        assert again.counter("dsaserve_worker_requests_total", outcome="ok") == 2

        with grpc.insecure_channel(decode.address) as channel:
            request = pb.DecodeRequest(
                request_id=stale.request_id,
                prompt_token_ids=stale.prompt_token_ids,
                first_token_id=stale.response.first_token_id,
                sampling=stale.sampling,
                kv=stale.response.kv,
            )
            replies = list(
                grpc_api.DecodeStub(channel).Decode(
                    request, metadata=token_metadata(TOKEN), timeout=60
                )
            )
        assert [r.WhichOneof("kind") for r in replies] == ["error"], replies
        assert replies[0].error.cause == "peer_unknown"
        assert "restarted" in replies[0].error.message
        assert decode.failures("peer_unknown") == 1
        wait_all_kv_free(again, decode, timeout=30)
    finally:
        private_redis.resume()
        s.stop()


def _restart_in_place(s: Stack, prefill: Proc) -> Proc:
    """A new prefill worker with the killed one's id and addresses, as a container restart."""
    return s.worker(
        "prefill", "--worker-id", "prefill-a", port=prefill.port, metrics_port=prefill.metrics_port
    )


@dataclass
class HeldPrefill:
    """A Prefill sent straight to a worker: its KV stays held there under the lease."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    response: pb.PrefillResponse


def _prefill_directly(worker: Proc, request_id: str) -> HeldPrefill:
    prompt, sampling = [5] * 8, pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with grpc.insecure_channel(worker.address) as channel:
        response = grpc_api.PrefillStub(channel).Prefill(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
            metadata=token_metadata(TOKEN),
            timeout=60,
        )
    assert response.HasField("kv"), response
    return HeldPrefill(request_id, prompt, sampling, response)


def test_a_hung_decode_worker_fails_its_streams_within_seconds(tiny, redis_server, tmp_path):
    """A decode worker that stops mid-stream (SIGSTOP): gRPC keepalive notices, the stream ends
    with an error event long before the request timeout, and the prefill side frees all."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=6)
    try:
        prefill, decode = s.worker("prefill"), s.worker("decode")
        # Only keepalive can end the stream within the read timeout: the stall timeout is longer.
        router = s.router("--request-timeout", "600", "--stall-timeout", "300")
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000}
        body |= {"stream": True, "ignore_eos": True}
        # The read timeout bounds the wait for the error: far below the request timeout.
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            # The role chunk, the prefill's token, then one from decode: its stream is open.
            assert len([next(lines) for _ in range(3)]) == 3
            decode.proc.send_signal(signal.SIGSTOP)
            try:
                rest = list(lines)
            finally:
                decode.proc.send_signal(signal.SIGCONT)
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
        assert "unavailable" in rest[-2], rest[-2]
        wait_all_kv_free(prefill, decode, timeout=30)
    finally:
        s.stop()


def test_an_exposed_plaintext_worker_says_so_and_serves_without_redis(tiny, tmp_path):
    """Binding every interface without TLS is allowed, but said loudly in the log; a worker that
    cannot reach Redis at start serves anyway (and says so) until it can register."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsaserve.services.cli",
            "prefill",
            "--model",
            str(tiny),
            "--host",
            "0.0.0.0",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--cluster-token",
            "t",
            "--metrics-port",
            "0",
            "--port",
            "0",
        ],  # fmt: skip
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = []
    try:
        deadline = time.monotonic() + 120
        while not any("serving" in line and "worker" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
        proc.send_signal(signal.SIGTERM)
        lines += proc.stderr.readlines()
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)
    assert "plaintext" in log and "0.0.0.0" in log
    assert "registry unreachable" in log and "keeps trying to register" in log


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throwaway CA and one certificate that every process presents, naming no address: only
    `dsaserve-worker` (as in Kubernetes, where pods' addresses change; --grpc-tls-server-name)."""
    d = tmp_path_factory.mktemp("certs")
    ext = d / "san.ext"
    ext.write_text("subjectAltName=DNS:dsaserve-worker\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=dsaserve-test-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
            "-subj", "/CN=dsaserve-worker")  # fmt: skip
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return d


def test_grpc_with_mutual_tls_end_to_end(tiny, redis_server, tmp_path, certs):
    """Every internal link in mutual TLS: the stack serves, and a worker refuses both a
    plaintext client and a TLS client without a certificate."""
    tls = ["--grpc-tls-cert", str(certs / "node.pem"), "--grpc-tls-key", str(certs / "node.key"),
           "--grpc-tls-ca", str(certs / "ca.pem"),
           "--grpc-tls-server-name", "dsaserve-worker"]  # fmt: skip
    s = stack_in_db(tiny, redis_server, tmp_path, db=7)
    try:
        prefill = s.worker("prefill", *tls, "--grpc-tls-require-client-cert")
        decode = s.worker("decode", *tls, "--grpc-tls-require-client-cert")
        router = s.router(*tls)
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        assert answer(chat(url, PROMPTS[2]))
        load = pb.LoadRequest()
        with grpc.insecure_channel(prefill.address) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                grpc_api.PrefillStub(plain).Load(load, metadata=token_metadata(TOKEN), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        name = (("grpc.ssl_target_name_override", "dsaserve-worker"),)
        with grpc.secure_channel(prefill.address, anonymous, options=name) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                grpc_api.PrefillStub(channel).Load(load, metadata=token_metadata(TOKEN), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        prefill.credentials = grpc.ssl_channel_credentials(
            *((certs / name).read_bytes() for name in ("ca.pem", "node.key", "node.pem"))
        )
        prefill.server_name = "dsaserve-worker"
        wait_for(prefill.all_kv_free, 30, "prefill to free every page")
    finally:
        s.stop()


def test_a_short_soak_with_faults_ends_every_request_and_leaks_nothing(tiny, tmp_path):
    """loadtest/soak.py as CI can afford it: users stream while the decode worker is killed and
    restarted and Redis is stopped; every request ends (answered or a clear error) and, once
    idle, every page is free on both workers."""
    from loadtest.soak import Fault, SoakConfig, run_soak

    cfg = SoakConfig(
        users=3,
        seconds=20.0,
        faults=[Fault("kill-decode", 4.0, 3.0), Fault("stop-redis", 11.0, 3.0)],
        model=str(tiny),
        output_tokens=(4, 24),
        lease_s=3.0,
        quiet_s=8.0,
        log_dir=str(tmp_path),
    )
    result = run_soak(cfg)
    assert result["hung"] == 0
    assert result["outcomes"].get("ok", 0) > 0, result["outcomes"]
    clear = {"ok", "HTTP 429", "HTTP 503", "HTTP 504", "error event in stream"}
    assert set(result["outcomes"]) <= clear, result["errors"]
    assert result["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert [e["fault"] for e in result["fault_events"] if e["begin"]] == [
        "kill-decode",
        "stop-redis",
    ]


def test_the_stall_timeout_stretches_with_a_slow_decode_workers_measured_steps(
    tiny, redis_server, tmp_path
):
    """A decode worker whose every step takes 1.5 s against a router's 1 s --stall-timeout: once
    its registry record carries its measured step time, its streams are not abandoned as
    stalled (the stall deadline is 20 of its steps, the flag only the floor)."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=8)
    try:
        simulate = ("--simulate", str(slow_profile(tmp_path / "slow.json", 1500.0)))
        prefill, decode = s.worker("prefill", *simulate), s.worker("decode", *simulate)
        router = s.router("--stall-timeout", "1")
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        chat(url, "warm up", max_tokens=3)  # (its steps are what the record will carry)
        registry = redis.Redis.from_url(s.redis_url, socket_timeout=5)

        def recorded_step_ms() -> int:
            value = registry.get(worker_key(decode.name))
            return (
                value
                and unseal(worker_key(decode.name), value, TOKEN, time.time(), s.ttl).load.step_ms
            )

        wait_for(lambda: recorded_step_ms() >= 1000, 30, "the decode record's step time")
        registry.close()
        wait_for_a_refresh(url)
        response = chat(url, "slow but alive", max_tokens=6)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        wait_all_kv_free(prefill, decode, timeout=30)
    finally:
        s.stop()


def test_a_prompt_no_decode_worker_has_room_for_is_refused_before_it_is_prefilled(
    tiny, redis_server, tmp_path
):
    """While the decode side is full (here: one running request is over a 0.1% threshold), a new
    prompt waits at the router and gets 503 + Retry-After after --max-queue-delay without its
    prefill ever running; once the decode side drains, prompts are served again."""
    s = stack_in_db(tiny, redis_server, tmp_path, db=9)
    try:
        simulate = ("--simulate", str(slow_profile(tmp_path / "slow.json", 100.0)))
        prefill, decode = s.worker("prefill", *simulate), s.worker("decode", *simulate)
        router = s.router("--decode-kv-threshold", "0.001", "--max-queue-delay", "2")
        s.wait_ready(prefill, decode)
        url = s.wait_healthy(router)
        registry = redis.Redis.from_url(s.redis_url, socket_timeout=5)

        def decode_running() -> int:
            value = registry.get(worker_key(decode.name))
            record = unseal(worker_key(decode.name), value, TOKEN, time.time(), s.ttl)
            return record.load.running

        def prefilled() -> float:
            return prefill.counter("dsaserve_worker_requests_total", role="prefill", outcome="ok")

        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000}
        body |= {"stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert len([next(lines) for _ in range(3)]) == 3  # decoding on the decode worker
            wait_for(lambda: decode_running() == 1, 30, "the decode record to show it")
            wait_for_a_refresh(url)
            before = prefilled()
            refused = chat(url, "no room for me", max_tokens=4)
            assert refused.status_code == 503, refused.text
            assert "retry-after" in refused.headers
            assert refused.json()["error"]["code"] == "decode_full"
            assert prefilled() == before  # never computed
        wait_all_kv_free(prefill, decode, timeout=30)
        wait_for(lambda: decode_running() == 0, 30, "the decode record to show it idle")
        registry.close()
        wait_for_a_refresh(url)
        assert answer(chat(url, "room again", max_tokens=4))
    finally:
        s.stop()
