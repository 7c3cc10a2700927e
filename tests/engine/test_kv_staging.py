"""The arena pools and the staging buffer: a request's KV state packed on one engine and
scattered into another's pages, byte for byte, and decoded there as if it had never moved.

Blocks travel here by plain copies in place of NIXL READs (tests/services/test_transfer.py moves
them over NIXL, tests/e2e/test_staging.py through the whole stack).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.kv.allocator import OutOfPages
from dsaserve.engine.kv.layout import SLAB, STAGING, KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.kv.staging import CHUNK_BLOCKS, RING_SLOTS, BlockAllocator
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import tiny_config
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import assert_all_free, drain, move_staged

CFG = ModelConfig.from_hf(tiny_config(300))


def _pool(memory_bytes: int, staging_bytes: int | None = None) -> KVPool:
    kv = KVCacheConfig(
        memory_bytes,
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        staging_bytes=staging_bytes,
    )
    return KVPool(CFG, kv, dtype=torch.float32, device=torch.device("cpu"))


def _churned(pool: KVPool, tokens: int, seed: int) -> dict[str, list[int]]:
    """A request's pages after others came and went: scattered, in no particular order."""
    rng = np.random.default_rng(seed)
    pages = {}
    for name, group in pool.groups.items():
        taken = group.allocator.allocate(group.allocator.num_free)
        rng.shuffle(taken)
        n = pool.pages_for(name, tokens)
        group.allocator.free(taken[n:])
        pages[name] = taken[:n]
    pages[SLAB] = pool.slab.allocate(2)[1:]
    return pages


def test_every_pool_is_a_view_of_one_arena_at_whole_cells() -> None:
    pool = _pool(4 << 20)
    base, cell = pool.arena.data_ptr(), pool.cell_bytes
    spans = []
    for r in pool.regions():
        t = r.tensor
        assert t.is_contiguous() and t[0].nbytes % cell == 0, r.name
        if r.group != STAGING:
            assert (t.data_ptr() - base) % cell == 0, r.name
            spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    spans.sort()
    assert all(spans[k][1] <= spans[k + 1][0] for k in range(len(spans) - 1)), "regions overlap"
    for group in pool.groups.values():  # what the kernels read: [slots, D], one row stride
        for kv in group.kv.values():
            assert kv.is_contiguous() and kv.shape[1] == CFG.head_dim
            assert kv.shape[0] == group.num_pages * pool.page_size + pool.scratch_rows + 1
        for k in group.index_k.values():
            assert k.is_contiguous() and k.shape == (group.num_pages * pool.page_size + 1, 32)
    # The rings of every layer are disjoint parts of one slab row per request.
    rings = [t for pair in [*pool.comp_ring.values(), *pool.index_ring.values()] for t in pair]
    for t in rings:
        t[2].fill_(1.0)
    assert pool.slab_rows[2].sum() == sum(t[2].numel() for t in rings)
    assert pool.slab_rows[[0, 1, 3, 4]].abs().sum() == 0
    layout = pool.layout()
    assert layout["version"] == 3 and [r[0] for r in layout["regions"][-2:]] == [SLAB, STAGING]


def test_a_staged_state_lands_in_other_pages_byte_for_byte() -> None:
    prefill, decode = _pool(4 << 20, 1 << 20), _pool(3 << 20)  # other offsets, other counts
    raw = prefill.arena.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(1)))
    before = decode.arena.clone()
    tokens = 700  # a stream of several chunks, the last one partial
    theirs, ours = _churned(prefill, tokens, seed=1), _churned(decode, tokens, seed=2)
    blocks = prefill.stage(theirs)
    assert blocks is not None and len(blocks) > 2 * CHUNK_BLOCKS

    unpack = decode.unpacker(ours)
    assert unpack.nbytes == prefill.stream(theirs).size * prefill.cell_bytes
    move_staged(prefill, blocks, decode, unpack)
    for mine, other in zip(decode.regions(), prefill.regions(), strict=True):
        if mine.group == STAGING:
            continue
        got = _bytes(mine.tensor)[ours[mine.group]]
        want = _bytes(other.tensor)[theirs[other.group]]
        assert torch.equal(got, want), mine.name
    # Outside the request's pages (and the ring) nothing changed.
    changed = np.zeros(decode.cell_rows.shape[0], bool)
    changed[decode.cells(ours)] = True
    kept = torch.from_numpy(~changed)
    assert torch.equal(decode.cell_rows[kept], before.view(decode.cell_rows.shape)[kept])


def test_the_pages_a_reader_lacks_are_the_start_of_the_stream() -> None:
    """The stream puts the newest pages first: leaving out the full entry pages of a prefix
    (which a reader's cache holds) leaves the start of the whole stream, the bytes of the
    pages left, so a pull of the rest reads the first blocks only."""
    pool = _pool(4 << 20, 1 << 20)
    pages = _churned(pool, 700, seed=1)
    whole = pool.stream(pages)
    assert np.array_equal(np.sort(whole), np.sort(pool.cells(pages)))  # every cell, once
    for skip in (0, 3, 16, 64, 200, 650, 700):
        part = pool.stream(pages, skip)
        assert np.array_equal(part, whole[: part.size]), skip
        assert part.size * pool.cell_bytes == pool.stream_bytes(pool.missing(pages, skip))
    assert pool.stream(pages, 700).size < whole.size // 3


def test_a_request_staged_by_one_engine_decodes_on_another_as_if_never_moved(tiny) -> None:
    prompt = [(7 * i) % 250 + 3 for i in range(150)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = LLMEngine(tiny)
    alone.add_request("r", prompt, params)
    want = [t for o in drain(alone)["r"] for t in o.new_token_ids]

    prefill = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=64))
    prefill.add_request("r", prompt, params, prefill_only=True)
    (first,) = [t for o in drain(prefill)["r"] for t in o.new_token_ids]
    held = prefill.handoff.stage("r")
    assert set(held.pages) == {STAGING} and held.num_tokens == len(prompt)
    assert prefill.load().free_pages < prefill.load().total_pages  # the blocks are held
    groups = prefill.pool.groups.values()  # its pages back, but what only the prefix cache holds
    assert all(g.allocator.num_free + g.allocator.num_cached == g.num_pages - 1 for g in groups)

    decode = LLMEngine(tiny, EngineConfig(kv_cache_memory_bytes=128 << 20, max_num_seqs=8))
    for group in decode.pool.groups.values():  # other pages than the prefill worker's
        group.allocator.allocate(3)
    reserved = decode.handoff.reserve("r", prompt, first, params)
    move_staged(
        prefill.pool, held.pages[STAGING], decode.pool, decode.pool.unpacker(reserved.pages)
    )
    decode.handoff.join("r")
    assert [first] + [t for o in drain(decode)["r"] for t in o.new_token_ids] == want
    assert prefill.handoff.release("r")
    assert prefill.load().held == 0
    assert_all_free(prefill)


def test_staging_falls_back_to_pages_and_every_exit_frees_the_blocks(tiny) -> None:
    engine = LLMEngine(tiny)
    staging = engine.pool.staging
    params = SamplingParams(max_tokens=4, temperature=0)
    for rid in ("a", "b", "c", "d"):
        engine.add_request(rid, list(range(3, 60)), params, prefill_only=True)
    drain(engine)
    handoff = engine.handoff
    need = -(-engine.pool.cells(handoff.held_pages("a").pages).size // staging.cells_per_block)
    filler = staging.allocator.allocate(staging.num_free - 2 * need)  # room for two requests
    assert set(handoff.stage("a").pages) == set(handoff.stage("b").pages) == {STAGING}
    assert handoff.stage("a") == handoff.held_pages("a")  # staging twice is staging once
    held_c = handoff.stage("c")  # no room: it stays in its pages
    assert set(held_c.pages) == {*engine.pool.groups, SLAB} and staging.num_free == 0
    staging.free(filler)
    assert engine.abort("a") and staging.num_free == len(filler) + need
    assert handoff.release("c") and handoff.release("d")  # in pages, or never staged
    assert handoff.release("b")
    assert engine.load().held == 0 and staging.num_free == staging.num_total
    assert_all_free(engine)


def _bytes(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(torch.uint8).view(pages.shape[0], -1)  # [pages, page bytes]


def test_staging_blocks_come_in_as_few_runs_as_the_free_ones_allow() -> None:
    blocks = BlockAllocator(20)
    assert (blocks.allocate(0), blocks.allocate(3), blocks.allocate(4)) == (
        [],
        [0, 1, 2],
        [3, 4, 5, 6],
    )
    blocks.free([1])
    blocks.free([4, 5])
    assert blocks.allocate(2) == [4, 5]  # the smallest free run that fits
    assert blocks.allocate(11) == list(range(7, 18))
    blocks.free([0, 5, 6, 10, 11, 12])  # free runs: 0-1, 5-6, 10-12, 18-19
    assert blocks.allocate(6) == [0, 1, 5, 10, 11, 12]  # none fits: the longest ones first
    assert blocks.num_free == 3 and blocks.allocate(3) == [6, 18, 19]
    with pytest.raises(OutOfPages):
        blocks.allocate(1)
    blocks.free([3])
    with pytest.raises(AssertionError, match="double free"):
        blocks.free([3])


def test_a_pool_without_staged_room_still_pulls_and_gives_the_room_to_pages() -> None:
    """What a decode worker gets by default (kv_staging_memory_bytes 0): only the ring pulls
    land in, and the share staged requests would have had buys pages instead."""
    budget = 8 << 20
    shared, none = _pool(budget), _pool(budget, staging_bytes=0)
    assert none.staging.num_total == 0 < shared.staging.num_total  # blocks for staged requests
    assert none.staging.blocks.shape[0] == RING_SLOTS * CHUNK_BLOCKS  # the ring alone
    for name, group in none.groups.items():
        assert group.num_pages >= shared.groups[name].num_pages
    assert sum(g.num_pages for g in none.groups.values()) > sum(
        g.num_pages for g in shared.groups.values()
    )
    assert none.layout_hash() == shared.layout_hash()  # the two still pair
    assert none.stage(_churned(none, 40, seed=0)) is None  # no room: the pages stay


def test_a_negative_staging_share_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_staging_memory_bytes must be >= 0"):
        EngineConfig(kv_staging_memory_bytes=-1)
