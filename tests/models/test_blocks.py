"""Blocks of the engine's DeepSeek-V4 against their HF counterparts and their own invariants."""

from __future__ import annotations

import pytest
import torch

from dsaserve import kernels
from dsaserve.engine.kv.layout import KVCacheConfig
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.layers.rope import inverse_frequencies
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.weights import build_model, load_weights
from dsaserve.engine.step import RowSpan, StepState, build_step_inputs
from tests.hf_reference import VOCAB, make_hf_checkpoint

CSA_LAYER, HCA_LAYER = 1, 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(hf model, our model, config) loaded from one saved checkpoint."""
    path = tmp_path_factory.mktemp("blocks")
    hf = make_hf_checkpoint(path, seed=2)
    cfg = ModelConfig.from_dir(path)
    ours = build_model(cfg, torch.float32, torch.device("cpu"))
    load_weights(ours, path)
    return hf, ours, cfg


def _pool(cfg: ModelConfig, page_size: int = 4) -> KVPool:
    return KVPool(
        cfg,
        KVCacheConfig(
            memory_bytes=32 << 20, page_size=page_size, max_num_seqs=4, max_num_batched_tokens=128
        ),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sinkhorn_is_doubly_stochastic_and_matches_hf(pair, backend):
    hf, ours, cfg = pair
    n = cfg.hc_mult
    mixes = torch.randn(37, (2 + n) * n)
    base, scale = torch.randn((2 + n) * n), torch.rand(3) + 0.5
    with kernels.use_backend(backend):
        pre, post, comb = kernels.hc_weights(
            mixes, base, scale, n, cfg.hc_sinkhorn_iters, cfg.hc_eps
        )
    ref = kernels.reference.hc_weights(mixes, base, scale, n, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    for a, b in zip((pre, post, comb), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The sweeps end on the columns: those sum to 1 exactly, the rows nearly.
    assert torch.allclose(comb.sum(-2), torch.ones(37, n), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(37, n), atol=2e-2)
    assert (comb > 0).all() and (pre > 0).all() and ((post > 0) & (post < 2)).all()
    streams = torch.randn(1, 7, cfg.hc_mult, cfg.hidden_size)
    hf_post, hf_comb, hf_collapsed = hf.model.layers[0].attn_hc(streams)
    block = ours.layers[0]
    _, post, comb, x = block.hc_attn.pre(streams[0], block.attn_norm.weight)
    hf_x = hf.model.layers[0].input_layernorm(hf_collapsed[0])
    for a, b in ((post, hf_post[0]), (comb, hf_comb[0]), (x, hf_x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_yarn_frequencies_equal_hf(pair):
    hf, _, cfg = pair
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(
        inverse_frequencies(cfg.rope_compress, cfg.rope_dim),
        rotary.compress_inv_freq,
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        inverse_frequencies(cfg.rope_main, cfg.rope_dim), rotary.main_inv_freq, rtol=0, atol=0
    )


def test_routing_matches_hf_for_topk_and_hash_layers(pair):
    hf, ours, cfg = pair
    x = torch.randn(11, cfg.hidden_size)
    tokens = torch.randint(0, VOCAB, (11,))
    hash_layer, topk_layer = 0, cfg.num_layers - 1
    _, hf_w, hf_ids = hf.model.layers[hash_layer].mlp.gate(x, tokens)
    ids, w = ours.layers[hash_layer].ffn.gate(x, tokens)
    assert torch.equal(ids, hf_ids) and torch.equal(
        ids, ours.layers[hash_layer].ffn.gate.tid2eid[tokens]
    )
    torch.testing.assert_close(w, hf_w)
    _, hf_w, hf_ids = hf.model.layers[topk_layer].mlp.gate(x)
    ids, w = ours.layers[topk_layer].ffn.gate(x, tokens)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), hf_w.gather(1, hf_ids.argsort(-1)))
    # The selection bias changes which experts win, never the weights given to them.
    assert torch.allclose(w.sum(-1), torch.full((11,), cfg.routed_scaling_factor))


def _allocate(pool: KVPool, total: int) -> tuple[int, dict[str, list[int]]]:
    """A slab row and pages for `total` tokens, recorded in the pool's page tables."""
    slab = pool.slab.allocate(1)[0]
    tables = {g: pool.groups[g].allocator.allocate(pool.pages_for(g, total)) for g in pool.groups}
    for g, pages in tables.items():
        pool.write_page_table(slab, g, 0, pages)
    return slab, tables


def _entries(
    pool: KVPool, tables, group: str, layer: int, n: int, index: bool = False
) -> torch.Tensor:
    P, table = pool.page_size, tables[group]
    slots = [table[pool.ring_pages + w // P] * P + w % P for w in range(n)]
    src = pool.groups[group].index_k[layer] if index else pool.groups[group].kv[layer]
    return src[slots]


@pytest.mark.parametrize("chunks", [[61], [5, 1, 1, 1, 13, 40], [3, 4, 4, 50]])
def test_compressors_match_hf_cache_across_call_boundaries(pair, chunks):
    """CSA (main + indexer, overlapping windows) and HCA entries after prefill chunks of
    arbitrary sizes equal HF's compressed caches after one call."""
    hf, ours, cfg = pair
    total = sum(chunks)
    ids = torch.randint(0, VOCAB, (total,), generator=torch.Generator().manual_seed(total))
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).cache
    pool = _pool(cfg)
    slab, tables = _allocate(pool, total)
    start = 0
    for n in chunks:
        inp = build_step_inputs(
            pool, [RowSpan(start, n, slab, ids[start : start + n].tolist())], 0, torch.device("cpu")
        )
        ours(pool, inp, torch.tensor([n - 1]))
        start += n
    csa, hca = cache.layers[CSA_LAYER], cache.layers[HCA_LAYER]
    for name, index in (("compressor", False), ("indexer", True)):
        ref = csa.compressed_kv[name][0]
        torch.testing.assert_close(
            _entries(pool, tables, "csa", CSA_LAYER, ref.shape[0], index), ref, rtol=1e-5, atol=1e-5
        )
    ref = hca.compressed_kv["compressor"][0]
    assert ref.shape[0] == total // cfg.compress_rates["heavily_compressed_attention"]
    torch.testing.assert_close(
        _entries(pool, tables, "hca", HCA_LAYER, ref.shape[0]), ref, rtol=1e-5, atol=1e-5
    )


def test_indexer_picks_only_visible_entries(pair):
    """Row t may pick entry w only if (w+1)*4 <= t+1; with fewer than top-k visible it picks all."""
    _, ours, cfg = pair
    pool, total = _pool(cfg), 90
    slab, tables = _allocate(pool, total)
    inp = build_step_inputs(
        pool, [RowSpan(0, total, slab, list(range(total)))], 0, torch.device("cpu")
    )
    step = StepState(pool, inp, dict(ours.rope_tables))
    x = torch.randn(total, cfg.hidden_size)
    picked = ours.layers[CSA_LAYER].attn.indexer(
        x, torch.randn(total, cfg.q_lora_rank), step
    )  # [T, topk] entry positions
    for t in range(total):
        visible = (t + 1) // 4
        entries = sorted(int(w) for w in picked[t] if w >= 0)
        assert all(w < visible for w in entries)
        assert entries == (list(range(visible)) if visible <= cfg.index_topk else entries)
        assert len(entries) == min(visible, cfg.index_topk)
