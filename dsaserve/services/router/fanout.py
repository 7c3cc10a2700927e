"""A request's choices (`n`): one generation each, their events merged into one stream.

`fan_in` waits for every generation's first event, so a failed prefill is the request's HTTP
error before any answer went out, and then yields every event as (choice index, event) in the
order they arrive; a lone generation (n = 1) is read in the consumer's task, several each in a
task per read. However the merged stream ends (done, error, closed by its consumer,
cancelled), every generation is closed, which runs its cleanup (see pd.py). Closing never
awaits here: a stream cut off by a client that left is cancelled again at every await (anyio's
cancel scopes), so the closing runs in tasks of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from dsaserve.services.router.pd import Event

Indexed = tuple[int, Event]


async def fan_in(sources: Sequence[AsyncGenerator[Event, None]]) -> AsyncGenerator[Indexed, None]:
    """Every source's first event awaited (raising the first failure), then all events."""
    pending: dict[asyncio.Future[Event], int] = {
        asyncio.ensure_future(anext(source)): i for i, source in enumerate(sources)
    }
    firsts: dict[int, Event] = {}
    try:
        while len(firsts) < len(sources):
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for future in done:
                firsts[pending.pop(future)] = future.result()  # raises a failed prefill's error
    except BaseException:
        _close_later(pending, sources)
        raise
    return _merge(sources, firsts) if len(sources) > 1 else _only(sources[0], firsts[0])


async def _only(source: AsyncGenerator[Event, None], first: Event) -> AsyncGenerator[Indexed, None]:
    """One source (n = 1, the usual request): no task per event, as merging needs (this runs
    once per token). A cancellation while reading lands in the source itself, which ends it."""
    try:
        yield 0, first
        async for event in source:
            yield 0, event
    finally:
        _close_later({}, [source])


async def _merge(
    sources: Sequence[AsyncGenerator[Event, None]], firsts: dict[int, Event]
) -> AsyncGenerator[Indexed, None]:
    pending: dict[asyncio.Future[Event], int] = {}
    try:
        for i in sorted(firsts):
            yield i, firsts[i]
            pending[asyncio.ensure_future(anext(sources[i]))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                yield i, event
                pending[asyncio.ensure_future(anext(sources[i]))] = i
    finally:
        _close_later(pending, sources)


_closing: set[asyncio.Task[None]] = set()  # the event loop keeps only weak references to tasks


def _close_later(
    pending: dict[asyncio.Future[Event], int], sources: Sequence[AsyncGenerator[Event, None]]
) -> None:
    """Stop every read in flight and close every source (a no-op for finished ones)."""
    reads = {i: future for future, i in pending.items()}
    for future in reads.values():
        future.cancel()
    for i, source in enumerate(sources):
        task = asyncio.ensure_future(_close(reads.get(i), source))
        _closing.add(task)
        task.add_done_callback(_closing.discard)


async def _close(read: asyncio.Future[Event] | None, source: AsyncGenerator[Event, None]) -> None:
    # A generator can be closed only once no read runs in it; both steps end at once, since a
    # generation's cleanup never awaits.
    if read is not None:
        await asyncio.wait({read})
    await source.aclose()
