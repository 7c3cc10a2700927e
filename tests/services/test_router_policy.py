"""Balancing policies over plain WorkerRecords: who gets the next request."""

from __future__ import annotations

import collections
import random

import pytest

from dsaserve.engine.load import Load
from dsaserve.services.registry import WorkerRecord
from dsaserve.services.router.conversations import Conversations
from dsaserve.services.router.policy import (
    POLICIES,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
    load_of,
    make_policy,
)


def worker(worker_id: str, running: int = 0, waiting: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        "decode",
        f"{worker_id}:1",
        "m",
        "L",
        "agent",
        load=Load(running=running, waiting=waiting),
    )


def test_load_adds_router_inflight_to_registry_load() -> None:
    assert load_of(worker("a", running=2, waiting=3), {"a": 4, "b": 100}) == 9


def test_round_robin_cycles_through_workers() -> None:
    workers = [worker("a", running=50), worker("b"), worker("c")]
    policy = RoundRobin()
    assert [policy.choose(workers, {}).worker_id for _ in range(6)] == [
        "a",
        "b",
        "c",
        "a",
        "b",
        "c",
    ]


def test_least_load_counts_router_inflight() -> None:
    workers = [worker("a", running=1), worker("b", running=3), worker("c", waiting=2)]
    policy = LeastLoad(random.Random(0))
    assert policy.choose(workers, {}).worker_id == "a"
    assert policy.choose(workers, {"a": 5}).worker_id == "c"


def test_least_load_spreads_ties() -> None:
    workers = [worker("a"), worker("b"), worker("c")]
    policy = LeastLoad(random.Random(0))
    picks = collections.Counter(policy.choose(workers, {}).worker_id for _ in range(300))
    assert set(picks) == {"a", "b", "c"}


def test_power_of_two_never_picks_the_most_loaded() -> None:
    workers = [worker("idle"), worker("busy", running=10), worker("mid", running=5)]
    policy = PowerOfTwo(random.Random(1))
    picks = collections.Counter(policy.choose(workers, {}).worker_id for _ in range(300))
    assert picks["busy"] == 0
    assert picks["idle"] > picks["mid"] > 0  # idle wins every pair it is in (2 of 3)


def test_power_of_two_with_one_worker() -> None:
    only = worker("only", running=9)
    assert PowerOfTwo(random.Random(0)).choose([only], {}) is only


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_builds_every_listed_policy(name: str) -> None:
    workers = [worker("a"), worker("b")]
    assert make_policy(name, random.Random(0)).choose(workers, {}) in workers


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


def test_conversations_name_the_decode_worker_of_the_generation_a_prompt_continues() -> None:
    """The router's record of finished generations: a prompt that starts with all of one's
    tokens and goes on finds its decode worker and its length, the longest such one first
    (inside a block as well as across one); the oldest are forgotten past the capacity."""
    tokens = list(range(1, 400))
    record = Conversations(capacity=3)
    record.decoded("d1", tokens[:130])  # ends inside a block
    assert record.holder(tokens[:200]) == ("d1", 130)
    assert record.holder(tokens[:131]) == ("d1", 130)
    assert record.holder(tokens[:130]) is None  # (sent again: nothing past it)
    assert record.holder([0] + tokens[1:200]) is None  # another conversation
    assert record.holder(tokens[:200], "tenant-b") is None  # another namespace
    record.decoded("d9", tokens[:130], "tenant-b")
    assert record.holder(tokens[:200], "tenant-b") == ("d9", 130)
    record.decoded("d2", tokens[:192])  # ends at a block's end
    assert record.holder(tokens[:300]) == ("d2", 192)
    record.decoded("d3", [7, 8, 9])
    assert record.holder(tokens[:140]) is None  # d1's, the oldest, forgotten
    assert record.holder(tokens[:300]) == ("d2", 192)
