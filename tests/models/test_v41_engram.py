"""DeepSeek-V4.1's Engram: the n-gram hash ids of every position equal the reference's
(tests/reference_v41.py, from DeepSeek's inference/engram.py) however a sequence is cut into
steps (prefill chunks, decode rows whose earlier tokens came with the request, as a decode
worker gets them in a PD handoff); the device cache of hot rows returns what the table holds
and counts its hits as a direct-mapped cache does; a tokenizer whose normalized vocabulary is
not the config's is refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsaserve.engine.llm import LLM
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v41.engram_table import EngramTable, dequantize_rows
from dsaserve.engine.models.deepseek_v41.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.step import RowSpan, build_step_inputs
from tests.reference_v41 import EngramHashes, ReferenceV41

POOL = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v41_engram"), seed=3)


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(tiny, **POOL)


def sequence(n: int, seed: int) -> list[int]:
    return torch.randint(0, 265, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cuts", [(60,), (1, 59), (2, 3, 55), (37, 1, 1, 21), (5,) * 12])
def test_hashes_match_the_reference_however_the_sequence_is_cut(
    tiny: Path, llm: LLM, cuts: tuple[int, ...]
) -> None:
    """The same 60 tokens in steps of the given sizes, one request's step at a time beside two
    other requests' decode rows: each step's rows know the tokens before them only through
    their span's lookback (RowSpan.lookback, what the runner and a decode worker build from
    the request's own tokens); the hashes of every position are the reference's."""
    tokens = sequence(sum(cuts), 5)
    want = EngramHashes(ReferenceV41(tiny).cfg, tiny / "tokenizer.json")(tokens)
    others = [sequence(9, 6), sequence(4, 7)]
    pool, hasher = llm.engine.pool, llm.engine.model.hasher
    depth = pool.cfg.token_lookback
    got, start = [], 0
    for n in cuts:
        decode = [
            RowSpan(len(o) - 1, 1, pool.dummy_slab, [o[-1]], lookback=tuple(o[-1 - depth : -1]))
            for o in others
        ]
        chunk = RowSpan(
            start, n, pool.dummy_slab, tokens[start : start + n],
            lookback=tuple(tokens[max(0, start - depth) : start]),
        )  # fmt: skip
        inp = build_step_inputs(pool, [*decode, chunk], len(decode), torch.device("cpu"))
        hashes = hasher(
            inp.token_ids, inp.positions, inp.row_req, inp.req_past, inp.req_row0, inp.lookback
        )
        got.append(hashes[len(decode) :])
        start += n
    assert torch.equal(torch.cat(got), want)


def test_generation_counts_engram_lookups_and_cache_hits(llm: LLM) -> None:
    """Both tables' lookups (hash columns per row) and the hits of their device caches, as the
    worker exports them."""
    before = llm.engine.model.counters()
    llm.generate([sequence(50, 8)] * 2, SamplingParams(max_tokens=4, temperature=0))
    after = llm.engine.model.counters()
    lookups = after["engram_lookups"][1] - before["engram_lookups"][1]
    cfg = llm.engine.model_config.engram
    assert cfg is not None and lookups > 0 and lookups % cfg.hash_cols == 0
    assert 0 < after["engram_cache_hits"][1] - before["engram_cache_hits"][1] < lookups


def test_the_hot_row_cache_returns_what_the_table_holds() -> None:
    """Zipfian lookups of a 1,000-row table through a 64-slot cache: every lookup returns the
    table's rows, and the hits are a direct-mapped cache's (slot = id % 64, a slot's misses
    leave it to the largest id among them)."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, slots = 1000, 64, 64
    values = torch.randn(rows, dim, generator=gen)
    codes = (values * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.randint(120, 130, (rows, dim // 32), generator=gen, dtype=torch.uint8)
    table = EngramTable(codes, scales, torch.device("cpu"), torch.float32, slots)
    zipf = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    tags: dict[int, int] = {}
    hits = 0
    for _ in range(30):
        ids = torch.multinomial(zipf, 48, replacement=True, generator=gen)
        got = table.lookup(ids)
        assert torch.equal(got, dequantize_rows(codes[ids], scales[ids], torch.float32))
        batch = ids.tolist()
        hit = [tags.get(i % slots) == i for i in batch]
        hits += sum(hit)
        misses = [i for i, h in zip(batch, hit, strict=True) if not h]
        for slot in {i % slots for i in misses}:
            tags[slot] = max(i for i in misses if i % slots == slot)
    assert table.stats() == (30 * 48, hits) and hits > 30 * 48 // 4


def test_a_tokenizer_of_another_compressed_vocabulary_is_refused(tmp_path: Path) -> None:
    """Every multiplier derives from the compressed vocabulary's size: a mismatch would read
    every table at the wrong rows, silently; the load says so instead."""
    path = make_tiny_model(tmp_path, overrides={"engram_compressed_vocab_size": 255})
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        LLM(path, **POOL)
