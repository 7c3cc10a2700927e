"""Balancing policies: which of several interchangeable workers takes the next request.

A worker's load is what the registry last heard from it (running + waiting) plus the requests
this router has sent it since, which the registry cannot know yet: without that term a burst
between two heartbeats would all land on the worker that looked idle.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from services.registry import WorkerRecord


def load_of(worker: WorkerRecord, inflight: Mapping[str, int]) -> int:
    return worker.load.running + worker.load.waiting + inflight.get(worker.worker_id, 0)


class Policy(Protocol):
    def choose(self, workers: Sequence[WorkerRecord], inflight: Mapping[str, int]) -> WorkerRecord:
        """Pick one of `workers` (never empty); `inflight`: this router's calls per worker id."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, workers: Sequence[WorkerRecord], inflight: Mapping[str, int]) -> WorkerRecord:
        return workers[next(self._turn) % len(workers)]


class LeastLoad:
    """The least loaded worker; ties broken at random so equal workers share the traffic."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: Sequence[WorkerRecord], inflight: Mapping[str, int]) -> WorkerRecord:
        lowest = min(load_of(w, inflight) for w in workers)
        return self._rng.choice([w for w in workers if load_of(w, inflight) == lowest])


class PowerOfTwo:
    """Two random candidates, the less loaded wins: near least-load balance from stale load data
    without the herd effect of every router picking the same global minimum."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: Sequence[WorkerRecord], inflight: Mapping[str, int]) -> WorkerRecord:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if load_of(a, inflight) <= load_of(b, inflight) else b


POLICIES: dict[str, Callable[[random.Random | None], Policy]] = {
    "round_robin": lambda rng: RoundRobin(),
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
}


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    try:
        return POLICIES[name](rng)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
