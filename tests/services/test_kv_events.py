"""services.kv_events against a real redis-server: a worker's prefix cache (a real engine's)
published through its stream, the router's index following it, gaps, late joiners and outages,
and the cache_aware policy routing by what the index knows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.load import Load
from dsaserve.engine.prefix_cache.block_hash import block_hashes, cache_salt
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.services import kv_events
from dsaserve.services.kv_events import CacheEvent, CacheEventPublisher, CacheIndex, stream_key
from dsaserve.services.registry import WorkerRecord
from dsaserve.services.router.policy import CacheAware
from tests.conftest import PrivateRedis
from tests.engine_cases import byte_ids, drain

SALT, BLOCK = cache_salt("m", "L"), 8
WAIT_S = 15.0


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)  # polling a condition, bounded
    pytest.fail(f"timed out waiting for {what}")


def engine_drain(engine: LLMEngine):  # the worker's drain, without its engine thread
    async def drain_events(snapshot: bool):
        assert engine.prefix_cache is not None
        return engine.prefix_cache.take_events(snapshot)

    return drain_events


async def add(redis_url: str, worker_id: str, event: CacheEvent) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.xadd(stream_key(worker_id), event.fields())
    finally:
        await client.aclose()


def held(prompts: list[list[int]]) -> list[bytes]:
    return [h for p in prompts for h in block_hashes(p, SALT, BLOCK)]


@pytest.mark.asyncio
async def test_the_index_follows_a_workers_cache_through_its_stream(tiny, redis_url) -> None:
    engine = LLMEngine(tiny)
    cache = engine.prefix_cache
    assert cache is not None
    publisher = CacheEventPublisher(
        redis_url, "w1", "inc-1", cache.salt, cache.block, engine_drain(engine)
    )
    index = CacheIndex(redis_url, lambda: ["w1"])
    publisher.start()
    index.start()
    matched = lambda p: index.matched_tokens(["w1"], p)["w1"]
    try:
        a, b = byte_ids(300, 1), byte_ids(200, 2)
        for rid, prompt in (("a", a), ("b", b)):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0))
            drain(engine)
        await wait_until(lambda: matched(a) == 256 and matched(b) == 192, "both prompts' blocks")
        assert matched(a[:130] + byte_ids(50, 3)) == 128  # whole blocks of the shared start
        assert matched(byte_ids(300, 4)) == 0
        # A namespace (cache_salt, a tenant) matches only what was computed in it.
        salted = SamplingParams(max_tokens=2, temperature=0, cache_salt="tenant-x")
        engine.add_request("x", b, salted)
        drain(engine)
        in_x = lambda p: index.matched_tokens(["w1"], p, "tenant-x")["w1"]
        await wait_until(lambda: in_x(b) == 192, "the namespace's blocks")
        assert in_x(a) == 0 and index.matched_tokens(["w1"], b, "tenant-y")["w1"] == 0
        cache.clear()
        await wait_until(lambda: matched(a) == matched(b) == in_x(b) == 0, "the evictions")
        assert list(cache._roots) == [cache.salt]  # (an empty namespace goes)
        # A router that meets the worker now starts from its latest reset: in sync at once.
        engine.add_request("c", a, SamplingParams(max_tokens=2, temperature=0))
        drain(engine)
        await wait_until(lambda: matched(a) == 256, "the new blocks")
        late = CacheIndex(redis_url, lambda: ["w1"])
        late.start()
        try:
            await wait_until(lambda: late.matched_tokens(["w1"], a)["w1"] == 256, "a late reader")
        finally:
            await late.stop()
    finally:
        await index.stop()
        await publisher.stop()


@pytest.mark.asyncio
async def test_a_gap_leaves_the_worker_unknown_until_its_next_reset(redis_url) -> None:
    p, q = byte_ids(40, 5), byte_ids(40, 6)
    index = CacheIndex(redis_url, lambda: ["w2"])
    index.start()
    matched = lambda prompt: index.matched_tokens(["w2"], prompt)["w2"]
    try:
        await add(redis_url, "w2", CacheEvent("i", 1, True, held([p]), salt=SALT, block=BLOCK))
        await wait_until(lambda: matched(p) == 40, "the reset")
        await add(redis_url, "w2", CacheEvent("i", 2, False, held([q])))
        await wait_until(lambda: matched(q) == 40, "a change")
        await add(redis_url, "w2", CacheEvent("i", 4, False, []))  # entry 3 never came
        await wait_until(lambda: matched(p) == 0, "the gap to be noticed")
        await add(redis_url, "w2", CacheEvent("i", 5, False, held([p])))  # still out of sync
        await add(redis_url, "w2", CacheEvent("j", 1, True, held([q]), salt=SALT, block=BLOCK))
        await wait_until(lambda: matched(q) == 40, "the next reset (a restarted worker)")
        assert matched(p) == 0
    finally:
        await index.stop()


@pytest.mark.asyncio
async def test_silence_and_an_unreachable_redis_fall_back_to_nothing_matched(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_events, "STALE_S", 1.0)
    p = byte_ids(40, 7)
    index = CacheIndex(private_redis.url, lambda: ["w3"])
    index.start()
    matched = lambda: index.matched_tokens(["w3"], p)["w3"]
    try:
        await add(
            private_redis.url, "w3", CacheEvent("i", 1, True, held([p]), salt=SALT, block=BLOCK)
        )
        await wait_until(lambda: matched() == 40, "the reset")
        await wait_until(lambda: matched() == 0, "the worker's silence to count")
        await add(private_redis.url, "w3", CacheEvent("i", 2, False, []))
        await wait_until(lambda: matched() == 40, "the keepalive")
        private_redis.pause()
        await wait_until(lambda: matched() == 0, "Redis out of reach to count")
    finally:
        private_redis.resume()
        await index.stop()


# ---------------------------------------------------------------- cache_aware


def worker(worker_id: str, running: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id, "prefill", f"{worker_id}:1", "m", "L", "agent", load=Load(running=running)
    )


@pytest.mark.asyncio
async def test_cache_aware_prefers_the_holder_within_the_bound(redis_url) -> None:
    hot, cold = byte_ids(64, 8), byte_ids(64, 9)
    index = CacheIndex(redis_url, lambda: ["a", "b"])
    index.start()
    try:
        await add(redis_url, "a", CacheEvent("i", 1, True, held([hot]), salt=SALT, block=BLOCK))
        await add(redis_url, "b", CacheEvent("i", 1, True, [], salt=SALT, block=BLOCK))
        await wait_until(lambda: index.matched_tokens(["a"], hot)["a"] == 64, "the resets")
        policy = CacheAware(index, bound=2)
        a, b = worker("a", running=2), worker("b")
        assert policy.choose([a, b], {}, hot).worker_id == "a"  # 2 above the least: still a
        assert policy.choose([a, b], {"a": 1}, hot).worker_id == "b"  # 3 above: spread to b
        # both hold it now (b as far as this router knows): the less loaded of them
        assert policy.choose([a, worker("b", 3)], {}, hot).worker_id == "a"
        assert policy.choose([a, b], {}, hot).worker_id == "b"
        assert policy.choose([a, b], {}, cold).worker_id == "b"  # nobody holds it: least load
        assert policy.choose([a, worker("b", 2)], {}, cold).worker_id == "b"  # just sent there
        assert CacheAware(None).choose([a, b], {}, hot).worker_id == "b"  # no index: least load
    finally:
        await index.stop()


@pytest.mark.asyncio
async def test_a_decode_worker_gets_the_conversation_it_holds_while_it_has_room(redis_url) -> None:
    """cache_aware over decode workers: the one holding the prompt's start takes it while its
    KV use is under the room predicate (the router's --decode-kv-threshold), else the least
    loaded; what a router just sent somewhere counts only where asked (`routed`)."""
    turn, other = byte_ids(64, 10), byte_ids(64, 11)
    index = CacheIndex(redis_url, lambda: ["d1", "d2"])
    index.start()
    try:
        await add(redis_url, "d1", CacheEvent("i", 1, True, held([turn]), salt=SALT, block=BLOCK))
        await add(redis_url, "d2", CacheEvent("i", 1, True, [], salt=SALT, block=BLOCK))
        await wait_until(lambda: index.matched_tokens(["d1"], turn)["d1"] == 64, "the resets")

        def decode(worker_id: str, used: int, running: int = 0) -> WorkerRecord:
            load = Load(running=running, free_pages=100 - used, total_pages=100)
            return WorkerRecord(worker_id, "decode", f"{worker_id}:1", "m", "L", "a", load=load)

        room = lambda w: w.load.total_pages - w.load.free_pages <= 0.9 * w.load.total_pages
        policy = CacheAware(index, bound=4, room=room)
        assert policy.choose([decode("d1", 50, 1), decode("d2", 0)], {}, turn).worker_id == "d1"
        # the holder is full: the other, busier as it is
        assert policy.choose([decode("d1", 95), decode("d2", 0, 1)], {}, turn).worker_id == "d2"
        index.routed("d2", other)
        assert index.matched_tokens(["d2"], other) == {"d2": 64}
        assert index.matched_tokens(["d2"], other, routed=False) == {"d2": 0}
    finally:
        await index.stop()
