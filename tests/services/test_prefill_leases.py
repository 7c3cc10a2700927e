"""Claim, Release and Abort on a real prefill worker (in this process, over gRPC) while its engine
thread is held up by a deliberately slow step: the lease table answers them at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from dsaserve.engine.config import EngineConfig
from dsaserve.services.auth import token_metadata
from dsaserve.services.prefill.service import PrefillService
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.worker.leases import LeaseTable
from dsaserve.services.worker.process import Worker, now_ms
from dsaserve.services.worker.settings import PrefillSettings
from tests.serving_stack import slow_profile

TOKEN = "lease-token"
SLOW_STEP_S = 5.0  # how long the engine thread is held up
CONTROL_TIMEOUT_S = 1.0  # what each control call may take: a fifth of the slow step


async def start_worker(settings: PrefillSettings) -> tuple[Worker, asyncio.Future[None]]:
    """A prefill worker served in this process, once ready; and its serving task."""
    worker = Worker(settings, "prefill")
    serving = asyncio.ensure_future(worker.serve(PrefillService(worker)))
    deadline = time.monotonic() + 60
    while not worker.ready.is_set():
        assert not serving.done(), serving.result()
        assert time.monotonic() < deadline, "the worker did not become ready"
        await asyncio.sleep(0.05)  # polling a readiness flag, bounded by the deadline
    return worker, serving


@pytest.mark.asyncio
async def test_claims_are_answered_while_an_engine_step_is_slow(redis_url: str) -> None:
    engine = EngineConfig(
        kv_cache_memory_bytes=64 << 20, max_num_seqs=8, max_num_batched_tokens=256
    )
    settings = PrefillSettings(
        engine=engine, redis_url=redis_url, cluster_token=TOKEN, port=0, metrics_port=0
    )
    worker, serving = await start_worker(settings)
    metadata = token_metadata(TOKEN)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = grpc_api.PrefillStub(channel)
        sampling = pb.SamplingParams(max_tokens=4, temperature=0)
        for rid in ("r1", "r2"):
            held = await stub.Prefill(
                pb.PrefillRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=sampling),
                metadata=metadata,
                timeout=60,
            )
            assert held.HasField("kv")
        # A deliberately slow step: the engine thread is busy for SLOW_STEP_S.
        slow = worker.loop.call(time.sleep, SLOW_STEP_S)
        claim = pb.ClaimRequest(request_id="r1", hold_ms=30_000)
        claimed = await stub.Claim(claim, metadata=metadata, timeout=CONTROL_TIMEOUT_S)
        assert claimed.lease_expires_unix_ms > 0
        release = pb.ReleaseRequest(request_id="r1")
        released = await stub.Release(release, metadata=metadata, timeout=CONTROL_TIMEOUT_S)
        assert released.intact
        abort = pb.AbortRequest(request_id="r2")
        aborted = await stub.Abort(abort, metadata=metadata, timeout=CONTROL_TIMEOUT_S)
        assert aborted.found
        with pytest.raises(grpc.aio.AioRpcError) as gone:  # released: nothing to claim now
            await stub.Claim(claim, metadata=metadata, timeout=CONTROL_TIMEOUT_S)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        assert not slow.done()  # (all of it answered while the engine thread was held up)
        await asyncio.wrap_future(slow)
        # The engine freed both at its next drain (free, or kept by the prefix cache).
        deadline = time.monotonic() + 30
        while (
            load := worker.loop.load()
        ).held or load.free_pages + load.cached_pages < load.total_pages:
            assert time.monotonic() < deadline, f"KV not freed: {load}"
            await asyncio.sleep(0.05)  # polling the engine's load, bounded by the deadline
    worker.stop()
    await asyncio.wait_for(serving, 60)


@pytest.mark.asyncio
async def test_a_slow_workers_lease_follows_its_measured_step_time(
    redis_url: str, tmp_path: Path
) -> None:
    """Prompts at 3 tokens a second (a simulated slow worker) against a 1 s --lease-seconds:
    once a step is measured, the KV is held for 100 of its steps, and the handle says how long
    the steps take (the reader's Claim and Release deadlines stretch with it)."""
    engine = EngineConfig(
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        simulate=str(slow_profile(tmp_path / "slow.json", 10.0, prefill_tok_s=3.0)),
    )
    settings = PrefillSettings(
        engine=engine,
        redis_url=redis_url,
        cluster_token=TOKEN,
        port=0,
        metrics_port=0,
        lease_seconds=1.0,
    )
    worker, serving = await start_worker(settings)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = grpc_api.PrefillStub(channel)
        sampling = pb.SamplingParams(max_tokens=4, temperature=0)
        for rid in ("first", "second"):  # the first one's step is what the second one's follows
            held = await stub.Prefill(
                pb.PrefillRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=sampling),
                metadata=token_metadata(TOKEN),
                timeout=60,
            )
            lease_s = (held.kv.lease_expires_unix_ms - now_ms()) / 1000
        # 3 prompt tokens at 3 a second: a 1 s step (the average also counts the short steps
        # that only hand out a finished step's tokens)
        assert held.kv.step_ms >= 200, held.kv
        assert lease_s > 10, lease_s  # 100 steps, not the 1 s floor
    worker.stop()
    await asyncio.wait_for(serving, 60)


def test_a_lease_is_extended_by_claims_never_shortened_and_expires_once() -> None:
    """The lease table alone decides how long held KV waits for its reader (the engine only
    holds it until the worker releases it)."""
    leases, now = LeaseTable(), 100.0
    for rid in ("claimed", "idle", "late"):
        leases.hold(rid, now + 5.0)
    assert leases.claim("claimed", 60.0, now) == now + 60.0
    assert leases.claim("claimed", 1.0, now) == now + 60.0  # a shorter claim keeps the longer
    assert leases.claim("late", 60.0, now + 6.0) is None and "late" not in leases  # ran out
    assert leases.expire(now + 30.0) == ["idle"]
    assert leases.expire(now + 30.0) == []
    assert leases.drop("claimed", now + 59.0)  # held until then: what it read is intact
    assert not leases.drop("claimed", now + 59.0) and leases.claim("claimed", 1.0, now) is None
    leases.hold("slow", now)
    assert not leases.drop("slow", now + 1.0)  # its lease ended before the release
