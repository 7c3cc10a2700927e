"""Balancing policies: which of several interchangeable workers takes the next request.

A worker's load is what the registry last heard from it (running + waiting) plus the requests
this router has sent it since, which the registry cannot know yet: without that term a burst
between two heartbeats would all land on the worker that looked idle.

`CacheAware` (`--policy cache_aware`, the default) sends a prompt to the worker whose prefix cache
holds the longest start of it (services.kv_events), unless that worker's load exceeds the least
loaded one's by more than --balance-abs-threshold (4), so a hot prefix spreads instead of piling
up; an unknown or stale cache matches nothing and the least loaded worker takes the request.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from dsaserve.services.kv_events import CacheIndex
from dsaserve.services.registry import WorkerRecord

DEFAULT_BALANCE_BOUND = 4


def load_of(worker: WorkerRecord, inflight: Mapping[str, int]) -> int:
    return worker.load.running + worker.load.waiting + inflight.get(worker.worker_id, 0)


class Policy(Protocol):
    def choose(
        self,
        workers: Sequence[WorkerRecord],
        inflight: Mapping[str, int],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        """Pick one of `workers` (never empty); `inflight`: this router's calls per worker id;
        `prompt`: the request's token ids (a prefill's; empty for a decode); `cache_salt`: the
        prefix-cache namespace it may resume from (engine.prefix_cache.block_hash.salted)."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(
        self,
        workers: Sequence[WorkerRecord],
        inflight: Mapping[str, int],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        return workers[next(self._turn) % len(workers)]


class LeastLoad:
    """The least loaded worker; ties broken at random so equal workers share the traffic."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(
        self,
        workers: Sequence[WorkerRecord],
        inflight: Mapping[str, int],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        lowest = min(load_of(w, inflight) for w in workers)
        return self._rng.choice([w for w in workers if load_of(w, inflight) == lowest])


class PowerOfTwo:
    """Two random candidates, the less loaded wins: near least-load balance from stale load data
    without the herd effect of every router picking the same global minimum."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(
        self,
        workers: Sequence[WorkerRecord],
        inflight: Mapping[str, int],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if load_of(a, inflight) <= load_of(b, inflight) else b


class CacheAware:
    """SGLang's cache_aware: of the workers with room (all of them when none has), the one whose
    prefix cache holds the longest start of the prompt in the request's namespace
    (services.kv_events), unless its load exceeds the least loaded one's by more than `bound`,
    so a hot prefix spreads instead of piling up; ties, no match and unknown caches go to the
    least loaded. Every pick is remembered as cached there until the worker says otherwise."""

    def __init__(
        self,
        index: CacheIndex | None,
        bound: int = DEFAULT_BALANCE_BOUND,
        rng: random.Random | None = None,
        room: Callable[[WorkerRecord], bool] = lambda worker: True,
    ) -> None:
        """room: whether a worker can take a request now (a decode worker: KV pages)."""
        self._index, self._bound, self._least = index, bound, LeastLoad(rng)
        self._room = room

    def choose(
        self,
        workers: Sequence[WorkerRecord],
        inflight: Mapping[str, int],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> WorkerRecord:
        workers = [w for w in workers if self._room(w)] or workers  # (none has: all of them)
        if self._index is None or not prompt:
            return self._least.choose(workers, inflight)
        ids = [w.worker_id for w in workers]
        matched = self._index.matched_tokens(ids, prompt, cache_salt)
        best = max(matched.values())
        pick = self._least.choose(
            [w for w in workers if matched[w.worker_id] == best] if best else workers, inflight
        )
        if load_of(pick, inflight) > min(load_of(w, inflight) for w in workers) + self._bound:
            pick = self._least.choose(workers, inflight)
        self._index.routed(pick.worker_id, prompt, cache_salt)
        return pick


Room = Callable[[WorkerRecord], bool]
# name -> make(rng, cache index, balance bound, room)
POLICIES: dict[str, Callable[[random.Random | None, CacheIndex | None, int, Room], Policy]] = {
    "cache_aware": lambda rng, index, bound, room: CacheAware(index, bound, rng, room),
    "round_robin": lambda rng, index, bound, room: RoundRobin(),
    "least_load": lambda rng, index, bound, room: LeastLoad(rng),
    "power_of_two": lambda rng, index, bound, room: PowerOfTwo(rng),
}


def make_policy(
    name: str,
    rng: random.Random | None = None,
    index: CacheIndex | None = None,
    bound: int = DEFAULT_BALANCE_BOUND,
    room: Room = lambda worker: True,
) -> Policy:
    """index: what the workers' caches hold (cache_aware; None: unknown); room: whether a worker
    can take a request now (cache_aware sends it to the worker holding its prefix only then)."""
    try:
        return POLICIES[name](rng, index, bound, room)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
