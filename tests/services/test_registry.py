"""services.registry against a real redis-server: records, heartbeats, TTL expiry, the watcher."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from dsaserve.services import bounded_json
from dsaserve.services.registry import (
    MAX_RECORD_BYTES,
    Load,
    RegistryWatcher,
    UntrustedRecord,
    WorkerRecord,
    WorkerRegistration,
    seal,
    unseal,
    worker_key,
)
from tests import REPO_ROOT
from tests.conftest import PrivateRedis

TOKEN = "t"


def record(
    worker_id: str, role: str = "prefill", model: str = "m", layout: str = "L1"
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        address=f"127.0.0.1:{5000 + len(worker_id)}",
        model=model,
        layout_hash=layout,
        nixl_agent=f"agent-{worker_id}",
    )


async def wait_until(
    condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.02
) -> float:
    """Poll until `condition()` holds; return the seconds it took, fail after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


def test_record_json_round_trip_ignores_unknown_keys() -> None:
    rec = dataclasses.replace(
        record("w1"),
        load=Load(
            running=3, waiting=1, free_pages=7, total_pages=9, held=2, cached_pages=1, step_ms=40
        ),
    )
    data = json.loads(rec.to_json())
    assert data["load"] == {
        "running": 3,
        "waiting": 1,
        "free_pages": 7,
        "total_pages": 9,
        "held": 2,
        "cached_pages": 1,
        "step_ms": 40,
    }
    data["future_field"] = {"x": 1}
    data["load"]["future_load"] = 5
    assert WorkerRecord.from_json(json.dumps(data)) == rec


def test_only_a_fresh_record_signed_with_the_cluster_token_under_its_own_key_is_trusted() -> None:
    rec, now = record("w1"), time.time()
    key = worker_key("w1")
    assert unseal(key, seal(rec, TOKEN, now - 1), TOKEN, now, max_age_s=6) == rec
    tampered = json.loads(seal(rec, TOKEN, now))
    tampered["record"]["address"] = "10.6.6.6:50051"  # the rogue's address under a real signature
    forged = {
        "unsigned": rec.to_json(),
        "another token": seal(rec, "not-the-token", now),
        "tampered": json.dumps(tampered),
        "replayed": seal(rec, TOKEN, now - 60),  # a dead worker's old record
        "future": seal(rec, TOKEN, now + 60),
    }
    for what, value in forged.items():
        with pytest.raises(ValueError):
            unseal(key, value, TOKEN, now, max_age_s=6)
            pytest.fail(f"{what} record trusted")
    with pytest.raises(UntrustedRecord, match="not its key"):  # copied under another id
        unseal(worker_key("w2"), seal(rec, TOKEN, now), TOKEN, now, max_age_s=6)


def test_record_rejects_unknown_role() -> None:
    data = json.loads(record("w1").to_json()) | {"role": "router"}
    with pytest.raises(ValueError, match="role"):
        WorkerRecord.from_json(json.dumps(data))


@pytest.mark.asyncio
async def test_registration_writes_with_ttl_and_refreshes_load(redis_url: str) -> None:
    beats = itertools.count()
    reg = WorkerRegistration(
        redis_url, record("w1"), lambda: Load(running=next(beats)), TOKEN, ttl_s=0.6
    )
    client = aioredis.Redis.from_url(redis_url)
    await reg.start()
    try:
        assert 0 < await client.pttl(worker_key("w1")) <= 600

        async def load_running() -> int:
            raw = await client.get(worker_key("w1"))
            return unseal(worker_key("w1"), raw, TOKEN, time.time(), 0.6).load.running

        deadline = time.monotonic() + 5
        while await load_running() < 2:  # two heartbeats after the first write
            assert time.monotonic() < deadline, "heartbeat never refreshed the load"
            await asyncio.sleep(0.02)
    finally:
        await reg.stop()
    assert await client.exists(worker_key("w1")) == 0  # stop() deletes at once
    await client.aclose()


@pytest.mark.asyncio
async def test_watcher_filters_by_role_and_model(redis_url: str) -> None:
    regs = [
        WorkerRegistration(redis_url, rec, Load, TOKEN)
        for rec in (record("p1"), record("d1", role="decode"), record("p2", model="other"))
    ]
    watcher = RegistryWatcher(redis_url, TOKEN)
    for reg in regs:
        await reg.start()
    await watcher.start()
    try:
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]
        assert [w.worker_id for w in watcher.workers("prefill", model="m")] == ["p1"]
        assert [w.worker_id for w in watcher.workers("decode", model="m")] == ["d1"]
        await regs[0].stop()
        await watcher.refresh()
        assert watcher.workers("prefill", model="m") == []
    finally:
        await watcher.stop()
        for reg in regs:
            await reg.stop()


@pytest.mark.asyncio
async def test_watcher_skips_malformed_entries(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.set(worker_key("junk"), b"{not json")
    await client.set(worker_key("good"), seal(record("good"), TOKEN, time.time()))
    watcher = RegistryWatcher(redis_url, TOKEN)
    await watcher.start()
    try:
        assert [w.worker_id for w in watcher.workers("prefill")] == ["good"]
    finally:
        await watcher.stop()
        await client.aclose()


@pytest.mark.asyncio
async def test_a_poisoned_entry_is_ignored_and_the_watcher_keeps_refreshing(redis_url: str) -> None:
    """Under worker keys: 200,000 nested arrays (json.loads' RecursionError once killed the
    watcher), a value over the size bound (never fetched), a value that is not a string."""
    client = aioredis.Redis.from_url(redis_url)
    await client.set(worker_key("deep"), b"[" * 200_000 + b"]" * 200_000)
    await client.set(worker_key("huge"), b" " * (MAX_RECORD_BYTES + 1))
    await client.rpush(worker_key("list"), b"x")
    await client.set(worker_key("good"), seal(record("good"), TOKEN, time.time()))
    watcher = RegistryWatcher(redis_url, TOKEN, ttl_s=0.4)
    await watcher.start()
    try:
        assert [w.worker_id for w in watcher.workers("prefill")] == ["good"]
        assert watcher.untrusted == 3
        # Still refreshing: a worker added now is seen, and nothing made the loop restart.
        await client.set(worker_key("late"), seal(record("late"), TOKEN, time.time()))
        await wait_until(lambda: len(watcher.workers("prefill")) == 2, timeout_s=10)
        assert watcher.restarts == 0
    finally:
        await watcher.stop()
        await client.aclose()


def test_bounded_json_refuses_what_is_too_deep_or_too_long_and_skips_strings() -> None:
    assert bounded_json.loads('{"a": ["[[[[", {"b": 1}]}', 100, 3) == {"a": ["[[[[", {"b": 1}]}
    with pytest.raises(ValueError, match="deeper than 3"):
        bounded_json.loads("[[[[1]]]]", 100, 3)
    with pytest.raises(ValueError, match="more than the 4"):
        bounded_json.loads('"abcd"', 4, 3)
    with pytest.raises(ValueError):  # (json's own errors are ValueErrors too)
        bounded_json.loads("{not json", 100, 3)


@pytest.mark.asyncio
async def test_the_watcher_restarts_after_an_unexpected_error(redis_url: str) -> None:
    """A failure the watcher did not foresee (here: a reply it cannot read, injected once)
    restarts its loop on a new connection; it says so and goes on refreshing."""
    client = aioredis.Redis.from_url(redis_url)
    watcher = RegistryWatcher(redis_url, TOKEN, ttl_s=0.4)
    await watcher.start()
    read = watcher._read
    failed = False

    async def fails_once() -> tuple[list[WorkerRecord], bool]:
        nonlocal failed
        if not failed:
            failed = True
            raise RuntimeError("an unreadable reply")
        return await read()

    watcher._read = fails_once  # type: ignore[method-assign]
    try:
        await wait_until(lambda: watcher.restarts == 1, timeout_s=10)
        assert watcher.last_error == "RuntimeError: an unreadable reply"
        await client.set(worker_key("after"), seal(record("after"), TOKEN, time.time()))
        await wait_until(lambda: bool(watcher.workers("prefill")), timeout_s=10)
    finally:
        await watcher.stop()
        await client.aclose()


@pytest.mark.asyncio
async def test_a_worker_started_during_an_outage_registers_when_redis_is_back(
    private_redis,
) -> None:
    private_redis.pause()
    reg = WorkerRegistration(private_redis.url, record("late"), Load, TOKEN, ttl_s=0.6)
    try:
        assert await asyncio.wait_for(reg.start(), timeout=5) is False  # serving, unregistered
        private_redis.resume()
        client = aioredis.Redis.from_url(private_redis.url)
        deadline = time.monotonic() + 5
        while not await client.exists(worker_key("late")):
            assert time.monotonic() < deadline, "the heartbeat never registered the worker"
            await asyncio.sleep(0.05)
        await client.aclose()
    finally:
        private_redis.resume()
        await reg.stop()


@pytest.mark.asyncio
async def test_a_worker_writes_its_record_again_as_soon_as_it_vanishes(
    private_redis: PrivateRedis,
) -> None:
    """Flushed, deleted, or lost with a restarted Redis: the record is back long before the
    next beat (TTL/3 = 200 s here), so no router misses the worker for a refresh."""
    reg = WorkerRegistration(private_redis.url, record("w1"), Load, TOKEN, ttl_s=600.0)
    key = worker_key("w1")
    await reg.start()
    try:
        for lose in ("flushall", "delete", "restart"):
            client = aioredis.Redis.from_url(private_redis.url)
            if lose == "flushall":
                await client.flushall()
            elif lose == "delete":
                await client.delete(key)
            else:
                private_redis.restart()
                await client.aclose()
                client = aioredis.Redis.from_url(private_redis.url)
            deadline = time.monotonic() + 20
            while not await client.exists(key):
                assert time.monotonic() < deadline, f"the record never came back after {lose}"
                await asyncio.sleep(0.02)
            await client.aclose()
    finally:
        await reg.stop()


@pytest.mark.asyncio
async def test_watcher_start_fails_fast_without_redis(unused_tcp_port: int) -> None:
    watcher = RegistryWatcher(f"redis://127.0.0.1:{unused_tcp_port}/0", TOKEN, ttl_s=1.0)
    with pytest.raises((ConnectionError, OSError, aioredis.ConnectionError)):
        await asyncio.wait_for(watcher.start(), timeout=5)


_WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from dsaserve.engine.load import Load
    from dsaserve.services.registry import WorkerRecord, WorkerRegistration

    async def main():
        rec = WorkerRecord("killed", "decode", "127.0.0.1:1", "m", "L1", "agent-killed")
        await WorkerRegistration(sys.argv[1], rec, Load, "t", ttl_s=float(sys.argv[2])).start()
        print("registered", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.asyncio
async def test_killed_worker_leaves_the_snapshot_within_two_ttls(redis_url: str) -> None:
    ttl_s = 1.5
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _WORKER_SCRIPT,
        redis_url,
        str(ttl_s),
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    watcher = RegistryWatcher(redis_url, TOKEN, ttl_s=ttl_s)
    # (a survivor: with every worker gone at once the watcher would keep them one TTL longer)
    survivor = WorkerRegistration(redis_url, record("survivor"), Load, TOKEN, ttl_s=ttl_s)
    await survivor.start()
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), timeout=20) == b"registered\n"
        await watcher.start()
        assert [w.worker_id for w in watcher.workers("decode")] == ["killed"]
        proc.send_signal(signal.SIGKILL)  # no stop(): the key is left to expire
        await asyncio.wait_for(proc.wait(), timeout=10)
        took = await wait_until(lambda: not watcher.workers("decode"), timeout_s=5 * ttl_s)
        assert took <= 2 * ttl_s
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await watcher.stop()
        await survivor.stop()


@pytest.mark.asyncio
async def test_watcher_keeps_its_workers_while_redis_is_unreachable(
    private_redis: PrivateRedis,
) -> None:
    ttl_s = 1.0
    url = private_redis.url
    stays, leaves = (
        WorkerRegistration(url, record(worker_id), Load, TOKEN, ttl_s=ttl_s)
        for worker_id in ("p1", "p2")
    )
    watcher = RegistryWatcher(url, TOKEN, ttl_s=ttl_s)
    try:
        await stays.start()
        await leaves.start()
        await watcher.start()
        assert watcher.up

        private_redis.pause()
        await wait_until(lambda: not watcher.up, timeout_s=20)  # the watcher noticed
        # Well past a TTL without a refresh, the workers last seen are still routed to.
        await wait_until(lambda: watcher.last_refresh_age_s() > 3 * ttl_s, timeout_s=20)
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]

        private_redis.resume()
        await wait_until(lambda: watcher.up, timeout_s=20)
        # Every key expired while Redis was paused; until the workers beat again, the watcher
        # keeps them.
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]
        await leaves.stop()  # deregisters: deletes its key
        await wait_until(
            lambda: [w.worker_id for w in watcher.workers("prefill")] == ["p1"], timeout_s=20
        )
    finally:
        private_redis.resume()
        await watcher.stop()
        await stays.stop()
        await leaves.stop()


@pytest.mark.asyncio
async def test_a_flushed_registry_keeps_the_workers_until_they_write_their_records_again(
    redis_url: str,
) -> None:
    ttl_s = 1.5
    regs = [
        WorkerRegistration(redis_url, record(w), Load, TOKEN, ttl_s=ttl_s) for w in ("p1", "p2")
    ]
    watcher = RegistryWatcher(redis_url, TOKEN, ttl_s=ttl_s)
    client = aioredis.Redis.from_url(redis_url)
    try:
        for reg in regs:
            await reg.start()
        await watcher.start()
        await client.flushall()
        await watcher.refresh()  # finds nobody
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]
        await client.flushall()
        await client.set(worker_key("p1"), seal(regs[0].record, TOKEN, time.time()))  # p1's beat
        await watcher.refresh()  # finds p1 only: p2 has not beaten since
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]
        deadline = time.monotonic() + 10
        while await client.exists(worker_key("p1"), worker_key("p2")) < 2:  # their next beats
            assert time.monotonic() < deadline, "the workers never wrote their records again"
            await asyncio.sleep(0.05)
        await watcher.refresh()
        assert [w.worker_id for w in watcher.workers("prefill")] == ["p1", "p2"]
    finally:
        await watcher.stop()
        for reg in regs:
            await reg.stop()
        await client.aclose()
