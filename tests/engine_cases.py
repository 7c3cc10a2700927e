"""What the engine tests share: prompts, running an engine dry, and checking it holds nothing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv.pool import KVPool
from engine.kv.staging import CHUNK_BLOCKS, RING_SLOTS
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput

PROMPTS = [
    "The quick brown fox",
    "a",
    "0123456789" * 9,
    "Once upon a time, in a land far away,",
    "zz" * 30,
]


def byte_ids(n: int, seed: int) -> list[int]:
    """n random byte tokens (both tiny models' tokenizers have the 256 bytes)."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(engine: LLMEngine, limit: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished (in-flight steps included); each request's outputs.
    Fails if a request gets an output after its finishing one."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            assert not any(o.finished for o in outputs.get(out.request_id, [])), (
                f"{out.request_id} got an output after its last"
            )
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def assert_all_free(engine: LLMEngine) -> None:
    """No request left anywhere, every page and slab row free but those only the prefix cache
    holds; then, the cache emptied, every page and checkpoint row free."""
    load = engine.load()
    assert load.free_pages + load.cached_pages == load.total_pages == engine.pool.num_total_pages
    assert load.running == load.waiting == 0
    assert engine.pool.slab.num_free == engine.config.max_num_seqs
    assert not engine.scheduler.requests
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        assert engine.prefix_cache.num_checkpoints == 0 and not engine.prefix_cache.root.children
    assert engine.load().free_pages == load.total_pages and engine.load().cached_pages == 0
    rows = engine.pool.checkpoint_slab
    assert rows.num_free == rows.num_pages
    host = engine.runner.host
    assert host is None or host.num_free == host.allocator.num_pages


def move_staged(
    src: KVPool, blocks: list[int], dst: KVPool, unpack: Callable[[int, int], None]
) -> None:
    """What a pull does, with copies for READs: chunk j of the stream into ring slot j % slots."""
    for j in range(0, len(blocks), CHUNK_BLOCKS):
        chunk = blocks[j : j + CHUNK_BLOCKS]
        slot = dst.staging.ring[(j // CHUNK_BLOCKS) % RING_SLOTS]
        dst.staging.blocks[slot[: len(chunk)]] = src.staging.blocks[chunk]
        unpack(j // CHUNK_BLOCKS, (j // CHUNK_BLOCKS) % RING_SLOTS)
