"""DeepSeek-V3.2's KV state in the paged pools: one group whose every token keeps a 576-wide
latent row and an index key (no window ring, no scratch rows, no slab state), its FP8 pages
(FlashMLA's 656-byte rows, the FP8 index keys), and a prefilled request moved to another engine
(staged blocks or pages) decoding as if it never moved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve import kernels
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.kv.layout import SLAB, KVCacheConfig, bytes_per_token
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model as make_v4
from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model
from tests.engine_cases import (
    V32_WIDE,
    byte_ids,
    check_moved_request_decodes_as_if_never_moved,
    fp8_round_trip,
)

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=32 << 20)
PROMPT = byte_ids(150, 5)  # prefilled in three chunks; the indexer picks 8 of up to 150 rows


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("v32_wide"), overrides=V32_WIDE)


def test_the_pools_hold_one_latent_row_and_one_index_key_a_token(wide):
    cfg = ModelConfig.from_dir(wide)
    kv = KVCacheConfig(8 << 20, 16, max_num_seqs=4, max_num_batched_tokens=64, staging_bytes=0)
    pool = KVPool(cfg, kv, dtype=torch.bfloat16, device=torch.device("cpu"))
    (group,) = pool.groups.values()
    assert group.name == "mla" and group.ratio == 1 and pool.ring_pages == 0
    for layer in range(3):  # pages, then only the trash row: rows go straight to their slots
        assert group.kv[layer].shape == (group.num_pages * 16 + 1, 576)
        assert group.index_k[layer].shape == (group.num_pages * 16 + 1, 64)
    assert pool.pages_for("mla", 33) == 3 and pool.token_capacity() == (group.num_pages - 1) * 16
    assert pool.comp_ring == pool.index_ring == {}
    # a token of context: every layer's bf16 row and key; FP8: 656 + 68 bytes
    assert bytes_per_token(cfg, 2) == 3 * (576 + 64) * 2
    assert bytes_per_token(cfg, 2, fp8=True) == 3 * (656 + 68)
    fp8 = KVPool(cfg, dataclasses.replace(kv, kv_cache_dtype="fp8"), dtype=torch.bfloat16,
                 device=torch.device("cpu"))  # fmt: skip
    (fp8_group,) = fp8.groups.values()
    assert fp8_group.kv[0].dtype == torch.uint8 and fp8_group.kv[0].shape[1] == 16 * 656
    assert fp8_group.num_pages > 1.7 * group.num_pages  # the same bytes hold more tokens
    assert "deepseek_v32" in pool.layout_description()


def test_layouts_name_the_family(wide, tmp_path):
    """A V3.2 pool and a V4 pool never share a hash, and each description says which family."""
    ours = LLMEngine(wide, EngineConfig(**ENGINE)).pool
    theirs = LLMEngine(make_v4(tmp_path), EngineConfig(**ENGINE)).pool
    assert ours.layout()["family"] == "deepseek_v32" and theirs.layout()["family"] == "deepseek_v4"
    assert ours.layout_hash() != theirs.layout_hash()
    assert "(deepseek_v4," in theirs.layout_description()


def test_fp8_pages_compute_what_fp8_round_tripped_rows_compute(wide):
    """Every row V3.2 stores (latent rows and index keys, prefill and decode) goes through
    KVPool.write, and every read dequantizes: the FP8 engine computes what the plain engine
    computes on FP8 round-tripped rows; and it does differ from the plain engine."""
    sequence = PROMPT[:90]
    fp8 = LLM(wide, kv_cache_dtype="fp8", **ENGINE).score(sequence)
    plain = LLM(wide, **ENGINE)
    assert not torch.allclose(fp8, plain.score(sequence), atol=1e-3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            kernels,
            "store_rows",
            lambda pool, slots, rows, _: pool.index_copy_(0, slots, fp8_round_trip(rows)),
        )
        simulated = plain.score(sequence)
    torch.testing.assert_close(fp8, simulated, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("via", ["staging", "pages"])
def test_a_prefilled_request_decodes_on_another_engine_as_if_never_moved(wide, via, kv_cache_dtype):
    """The staged pull (blocks through the ring) and the page READ move every byte a V3.2
    request keeps: its latent rows and index keys, in pages numbered differently there."""
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, **ENGINE)
    check_moved_request_decodes_as_if_never_moved(wide, config, PROMPT, via, {"mla", SLAB})
