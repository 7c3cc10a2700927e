"""services.router.decode_room: the decode side's room bounds the prompts a router prefills,
counting the requests it has on their way to decode (no record shows them yet)."""

from __future__ import annotations

import asyncio

import pytest

from dsaserve.services.registry import Load, WorkerRecord
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.decode_room import DecodeRoom


def decode_worker(used: int, running: int, total: int = 100) -> WorkerRecord:
    load = Load(running=running, free_pages=total - used - 5, cached_pages=5, total_pages=total)
    return WorkerRecord("d1", "decode", "127.0.0.1:1", "m", "L", "agent", load=load)


@pytest.mark.asyncio
async def test_requests_in_transit_count_until_they_leave_and_a_held_prompt_then_enters() -> None:
    # 40 pages used by 4 running requests (10 each), 90% of 100 pages may be spoken for:
    # 40 + 5 * 10 = 90 fits, a sixth request on its way would not.
    worker = decode_worker(used=40, running=4)
    room = DecodeRoom(lambda: [worker], threshold=0.9, max_wait_s=60, retry_after_s=3)
    transits = [await room.enter(60) for _ in range(5)]
    assert room.in_transit == 5
    held = asyncio.ensure_future(room.enter(60))
    while room.waiting == 0:  # (until it is held back, not a timing)
        await asyncio.sleep(0)
    assert not held.done()
    transits[0].leave()
    transits[0].leave()  # (idempotent)
    transits.append(await asyncio.wait_for(held, 10))
    assert room.in_transit == 5 and room.waiting == 0


@pytest.mark.asyncio
async def test_a_prompt_held_past_the_wait_is_refused_with_retry_after() -> None:
    room = DecodeRoom(lambda: [decode_worker(80, 4)], 0.9, max_wait_s=0.2, retry_after_s=3)
    with pytest.raises(APIError) as refused:
        await room.enter(60)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "3"
    assert room.in_transit == room.waiting == 0


@pytest.mark.asyncio
async def test_an_idle_or_unknown_decode_side_has_room() -> None:
    for workers in ([], [decode_worker(used=0, running=0)]):
        room = DecodeRoom(lambda workers=workers: workers, 0.5, max_wait_s=0.1, retry_after_s=1)
        for _ in range(3):
            await room.enter(60)
        assert room.in_transit == 3
