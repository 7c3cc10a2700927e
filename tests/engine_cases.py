"""What the engine tests share: prompts, running an engine dry, and checking it holds nothing."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.kv.layout import SLAB, STAGING
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.kv.staging import CHUNK_BLOCKS, RING_SLOTS
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.request import KVPages, RequestOutput
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.kernels import kv_quant

PROMPTS = [
    "The quick brown fox",
    "a",
    "0123456789" * 9,
    "Once upon a time, in a land far away,",
    "zz" * 30,
]


# DeepSeek-V3.2's row widths (512 latent + 64 RoPE: the FP8 format's) on a tiny V3.2 model
V32_WIDE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 64}


def fp8_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """Rows as an FP8 pool returns them: V4's attention entries (512 wide), V3.2's latent rows
    (576 wide) or index keys (any other width)."""
    if rows.shape[1] == kv_quant.KV_DIM:
        back = kv_quant.dequantize_kv(kv_quant.quantize_kv(rows))
    elif rows.shape[1] == kv_quant.V32_DIM:
        back = kv_quant.dequantize_kv_v32(kv_quant.quantize_kv_v32(rows))
    else:
        back = kv_quant.dequantize_index_k(kv_quant.quantize_index_k(rows))
    return back.to(rows.dtype)


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


def move(src: KVPool, held: KVPages, dst: KVPool, reserved: KVPages) -> int:
    """What a pull does, with copies for READs: the first part of the staged stream, or the
    held pages, but the pages `reserved` shares from its engine's prefix cache (KVPool.missing),
    into the first of the reserved pages (a borrowed prefix fills only some). Returns the pages
    moved (the slab row not counted)."""
    skip = reserved.reused_tokens
    if STAGING in held.pages:
        unpack = dst.unpacker(reserved.pages, skip)
        blocks = held.pages[STAGING][: -(-unpack.nbytes // dst.staging.block_bytes)]
        move_staged(src, blocks, dst, unpack)
        return sum(len(p) for g, p in dst.missing(reserved.pages, skip).items() if g != SLAB)
    theirs = src.missing(held.pages, skip)
    ours = {g: p[: len(theirs[g])] for g, p in dst.missing(reserved.pages, skip).items()}
    for a, b in zip(src.regions(), dst.regions(), strict=True):
        if a.group in theirs:
            b.tensor[ours[b.group]] = a.tensor[theirs[a.group]]
    return sum(len(pages) for group, pages in ours.items() if group != SLAB)


def check_moved_request_decodes_as_if_never_moved(
    model: str | os.PathLike,
    config: EngineConfig,
    prompt: list[int],
    via: str,
    groups: set[str],
    params: SamplingParams | None = None,
) -> list[int]:
    """A request prefilled and held by one engine, its KV moved to another engine with other
    page numbers (`via` "staging": the staged blocks through the ring, as a pull moves them;
    "pages": the held pages, as one READ copies them), decodes the tokens it decodes alone
    (returned). groups: the pool groups (and "slab") a held request's pages are in; params:
    its sampling (default: 6 greedy tokens)."""
    params = params or SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = LLMEngine(model, config)
    alone.add_request("r", prompt, params)
    want = [t for o in drain(alone)["r"] for t in o.new_token_ids]

    prefill = LLMEngine(model, config)
    prefill.add_request("r", prompt, params, prefill_only=True)
    (first,) = [t for o in drain(prefill)["r"] for t in o.new_token_ids]
    held = prefill.handoff.stage("r") if via == "staging" else prefill.handoff.held_pages("r")
    assert set(held.pages) == ({STAGING} if via == "staging" else groups)

    decode = LLMEngine(model, dataclasses.replace(config, max_num_seqs=3))  # other page counts
    for group in decode.pool.groups.values():  # other pages than the prefill engine's
        group.allocator.allocate(3)
    assert decode.pool.layout_hash() == prefill.pool.layout_hash()
    reserved = decode.handoff.reserve(
        "r", prompt, first, params, draft_token_ids=held.draft_token_ids,
        draft_confidences=held.draft_confidences,
    )  # fmt: skip
    assert reserved is not None
    move(prefill.pool, held, decode.pool, reserved)
    decode.handoff.join("r")
    assert [first] + [t for o in drain(decode)["r"] for t in o.new_token_ids] == want
    if alone.speculator is not None:  # drafts from the first decode step on, as never moved
        assert held.draft_token_ids and decode.speculator is not None
        assert decode.speculator.stats == alone.speculator.stats
    assert prefill.handoff.release("r")
    return want
