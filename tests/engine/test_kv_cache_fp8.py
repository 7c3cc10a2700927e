"""`--kv-cache-dtype fp8`, for each family: DeepSeek-V4's built-in demo model (512-wide KV rows
with 64 RoPE dims, the FP8 format's; the tiny test models' 64-wide rows are refused) and a tiny
DeepSeek-V3.2 at its release's row widths (576-wide latent rows: FlashMLA's 656-byte FP8 rows,
FP8 index keys). The pools hold kernels.kv_quant's pages, every row written is read back as its
FP8 round trip, a prefilled request moves to another engine byte for byte (FP8 pages or not),
and pools whose caches or families differ never pair. V4's own: generation stays close to the
model-dtype cache, a budget holds ~1.77x the tokens, and workers whose caches differ never pair.
V3.2's own: one group whose every token keeps a latent row and an index key (no window ring, no
scratch rows, no slab state).

Numbers behind V4's bounds (bench/results/cpu-kv-cache-dtype.json, 8 prompts x 32 greedy steps):
with fp32 activations the FP8 cache moves the demo model's decode logits by 0.81 at most and
0.034 on average (logit std ~7), greedy tokens agree on 93% of positions (98.8% teacher-forced),
bits per byte +0.02%; about what bf16 arithmetic alone does to the fp32 engine (0.82, 0.030,
85%, 99.2%).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from bench.kv_cache_dtype import step_logits
from bench.numerics import BOS, heldout_windows
from dsaserve import kernels
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import SLAB, KVCacheConfig, bytes_per_token
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.config import ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model
from dsaserve.kernels import fused_reference, kv_quant
from dsaserve.services import settings
from dsaserve.services.auth import token_metadata
from dsaserve.services.rpc import grpc_api, pb
from dsaserve.services.transfer.layout import Region, describe, first_difference
from tests.engine_cases import (
    V32_WIDE,
    byte_ids,
    check_moved_request_decodes_as_if_never_moved,
    fp8_round_trip,
)
from tests.model_fixtures import FAMILIES, families
from tests.serving_stack import TOKEN, Stack, offline_generate, wait_for

MODEL = DEMO_MODEL_DIR
CFG = ModelConfig.from_dir(MODEL)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=96, kv_cache_memory_bytes=32 << 20)
# Past the 128-token window (prefilled in two chunks of 96): compressed entries and the
# indexer's top-k (32 of 42 CSA entries) are read from the FP8 pages.
PROMPT = [BOS, *heldout_windows(1, 512)[0][:170]]
STEPS = 6


def _simulate_fp8_writes(mp: pytest.MonkeyPatch) -> None:
    """Make a plain-pool engine store every row as its FP8 round trip, through the three ways
    rows reach a pool (the CPU path's torch references)."""
    attention_pre, entries = fused_reference.attention_pre, fused_reference.compress_decode_entries

    def pre(q, kv, weight, eps, cos, sin, cache, scratch, ring):
        q, kv = attention_pre(q, kv, weight, eps, cos, sin, None, scratch, ring)
        cache.index_copy_(0, scratch, fp8_round_trip(kv))
        cache.index_copy_(0, ring, fp8_round_trip(kv[: ring.shape[0]]))
        return q, kv

    def compress(*args):
        *inputs, target, trash = args
        rows, slots = entries(*inputs)
        target.index_copy_(0, torch.where(slots >= 0, slots, trash), fp8_round_trip(rows))

    mp.setattr(fused_reference, "attention_pre", pre)
    mp.setattr(fused_reference, "compress_decode", compress)
    mp.setattr(
        kernels,
        "store_rows",
        lambda pool, slots, rows, _: pool.index_copy_(0, slots, fp8_round_trip(rows)),
    )


def _simulate_fp8_stores(mp: pytest.MonkeyPatch) -> None:
    """The same for V3.2, whose every row (latent rows and index keys, prefill and decode) goes
    through KVPool.write: kernels.store_rows."""
    mp.setattr(
        kernels,
        "store_rows",
        lambda pool, slots, rows, _: pool.index_copy_(0, slots, fp8_round_trip(rows)),
    )


@dataclass(frozen=True)
class Fp8Case:
    model: Callable[[Path], Path]  # a checkpoint whose rows have the FP8 format's widths
    engine: dict
    prompt: list[int]  # prefilled in chunks, then moved
    scored: list[int]  # scored in chunks
    groups: set[str]  # the pool groups (and the slab) a held request's pages are in
    moved: tuple[str, ...]  # the kv_cache_dtypes a moved request is checked in
    simulate: Callable[[pytest.MonkeyPatch], None]  # a plain pool storing FP8 round trips


FP8 = {
    "deepseek_v4": Fp8Case(
        model=lambda _: MODEL,
        engine=ENGINE,
        prompt=PROMPT[:150],
        scored=PROMPT,
        groups={"swa", "csa", "hca", SLAB},
        moved=("fp8",),  # (the model dtype's move: test_kv_staging.py, on the tiny model)
        simulate=_simulate_fp8_writes,
    ),
    # the indexer picks 8 of up to 150 rows; prefilled in three chunks
    "deepseek_v32": Fp8Case(
        model=lambda d: FAMILIES["deepseek_v32"].make_tiny_model(d, overrides=V32_WIDE),
        engine=dict(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=32 << 20),
        prompt=byte_ids(150, 5),
        scored=byte_ids(150, 5)[:90],
        groups={"mla", SLAB},
        moved=("auto", "fp8"),
        simulate=_simulate_fp8_stores,
    ),
}


@pytest.fixture(scope="module")
def fp8_model(family, tmp_path_factory) -> Path:
    return FP8[family.name].model(tmp_path_factory.mktemp(f"fp8-{family}"))


@families()
def test_fp8_prefill_scores_what_fp8_round_tripped_rows_score(family, fp8_model):
    """Every row stored is read back dequantized: the FP8 engine scores what the plain engine
    scores when each row it stores (in chunks: later chunks read the earlier ones') is replaced
    by its FP8 round trip; and it does differ from the plain engine."""
    case = FP8[family.name]
    fp8 = LLM(fp8_model, kv_cache_dtype="fp8", **case.engine).score(case.scored)
    assert not torch.allclose(fp8, LLM(fp8_model, **case.engine).score(case.scored), atol=1e-3)
    with pytest.MonkeyPatch.context() as mp:
        case.simulate(mp)
        simulated = LLM(fp8_model, **case.engine).score(case.scored)
    torch.testing.assert_close(fp8, simulated, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "family, kv_cache_dtype, via",
    [(f, kv, via) for f, case in FP8.items() for kv in case.moved for via in ("staging", "pages")],
    indirect=["family"],
    scope="module",
)
def test_a_prefilled_request_decodes_on_another_engine_as_if_never_moved(
    family, fp8_model, kv_cache_dtype, via
):
    """tests/engine/test_kv_staging.py's move with these pools: the staged pull (blocks through
    the ring) and the page READ move every byte a request keeps (V3.2: its latent rows and index
    keys), FP8 pages as they are, into pages numbered differently there."""
    case = FP8[family.name]
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, **case.engine)
    check_moved_request_decodes_as_if_never_moved(fp8_model, config, case.prompt, via, case.groups)


def test_layouts_name_the_family(tmp_path):
    """Pools of different families never share a hash, and each description says which."""
    pools = {
        name: LLMEngine(family.make_tiny_model(tmp_path / name), EngineConfig(**ENGINE)).pool
        for name, family in FAMILIES.items()
    }
    for name, pool in pools.items():
        assert pool.layout()["family"] == name and f"({name}," in pool.layout_description()
    assert len({pool.layout_hash() for pool in pools.values()}) == len(pools)


# ---------------------------------------------------------------- DeepSeek-V4's own


@pytest.fixture(scope="module")
def auto() -> LLM:
    return LLM(MODEL, **ENGINE)


@pytest.fixture(scope="module")
def fp8() -> LLM:
    return LLM(MODEL, kv_cache_dtype="fp8", **ENGINE)


@pytest.fixture(scope="module")
def runs(auto, fp8) -> dict[str, tuple[list[int], torch.Tensor]]:
    """PROMPT's greedy tokens and the logits of every step (chunked prefill, then decode) with
    the model-dtype cache, the FP8 cache, and the model-dtype cache fed FP8 round-tripped rows."""
    out = {"auto": step_logits(auto, PROMPT, STEPS), "fp8": step_logits(fp8, PROMPT, STEPS)}
    with pytest.MonkeyPatch.context() as mp:
        _simulate_fp8_writes(mp)
        out["simulated"] = step_logits(LLM(MODEL, **ENGINE), PROMPT, STEPS)
    return out


def test_the_pools_hold_fp8_pages_and_the_rings_stay_in_the_model_dtype(fp8):
    pool = fp8.engine.pool
    P = pool.page_size
    for group in pool.groups.values():
        for kv in group.kv.values():  # window rows and compressed entries: 584 bytes a row
            assert kv.dtype == torch.uint8 and kv.shape[1] == P * kv_quant.KV_TOKEN_BYTES
            assert kv.shape[0] * P > pool.trash_slot(group.name)  # scratch and trash in pages
        for keys in group.index_k.values():  # index keys: 64 e4m3 codes + one fp32 scale
            assert keys.dtype == torch.uint8 and keys.shape == (group.num_pages + 1, P * 68)
    assert pool.slab_rows.dtype == torch.float32
    assert pool.layout()["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype=fp8" in pool.layout_description()


def test_fp8_pages_compute_what_fp8_round_tripped_rows_compute(runs):
    """Every write path quantizes and every read path dequantizes, nothing is missed: the FP8
    engine computes exactly what the plain engine computes when each row it stores (window rows
    in scratch and ring, compressed entries, index keys; prefill and decode) is replaced by its
    FP8 round trip."""
    tokens, logits = runs["fp8"]
    assert tokens == runs["simulated"][0]
    torch.testing.assert_close(logits, runs["simulated"][1], rtol=0, atol=1e-5)


def test_fp8_logits_stay_close_to_the_model_dtype_cache(auto, fp8, runs):
    """The logits move a little (and do move: the FP8 pages are read). Greedy steps compare
    while both continuations agree (this prompt's first step is a near tie, 7.8190 against
    7.8187, which FP8 flips); scoring one sequence compares every position past the window,
    where the argmax agrees almost everywhere."""
    (want_tokens, want), (got_tokens, got) = runs["auto"], runs["fp8"]
    assert got.shape == want.shape == (STEPS, CFG.vocab_size)
    pairs = enumerate(zip(want_tokens, got_tokens, strict=True))
    agree = next((i for i, (a, b) in pairs if a != b), STEPS)
    diff = (got[: agree + 1] - want[: agree + 1]).abs()
    assert 0 < diff.max() < 0.3, diff.max()
    sequence = [*PROMPT, *want_tokens]
    want, got = (
        auto.score(sequence)[CFG.sliding_window :],
        fp8.score(sequence)[CFG.sliding_window :],
    )
    diff = (got - want).abs()
    assert 0 < diff.max() < 0.5 and diff.mean() < 0.05, (diff.max(), diff.mean())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_prefill_reads_back_the_fp8_rows_decode_reads(runs):
    """A chunk's own rows (scratch) and earlier chunks' rows (ring, compressed entries) are read
    as their FP8 round trip, as decode reads them later: one whole-prompt step and chunked
    prefill + token-by-token decode give the same logits up to fp32 rounding."""
    tokens, decoded = runs["fp8"]
    whole = LLM(MODEL, kv_cache_dtype="fp8", **{**ENGINE, "max_num_batched_tokens": 1024})
    scored = whole.score([*PROMPT, *tokens[:-1]])[len(PROMPT) - 1 :]  # one prefill step
    torch.testing.assert_close(scored, decoded, rtol=0, atol=1e-4)


def test_the_same_budget_holds_more_tokens():
    """Budgets are bytes: a token of context costs 640 bytes of bf16 pages and 362.5 of FP8
    pages (1.766x; 3.53x against fp32, the CPU's default). Whole pools gain a bit more, as the
    fixed costs (every request's window and partial pages, the scratch rows) shrink too: at
    32 MiB for 4 requests 85760 tokens of context in FP8, 46336 in bf16 (1.85x)."""
    bf16, f32, fp8 = (bytes_per_token(CFG, e, f) for e, f in ((2, False), (4, False), (2, True)))
    # per token: 2 CSA layers (entry + key) / 4 + 1 HCA layer (entry) / 16; the window is fixed
    assert (bf16, fp8) == (2 * (1024 + 128) / 4 + 1024 / 16, 2 * (584 + 68) / 4 + 584 / 16)
    assert bf16 / fp8 == pytest.approx(1.7655, abs=1e-4) and f32 / fp8 == 2 * bf16 / fp8

    def pool(dtype: torch.dtype, kv_cache_dtype: str) -> KVPool:
        kv = KVCacheConfig(
            32 << 20, 64, max_num_seqs=4, max_num_batched_tokens=96, staging_bytes=0,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        return KVPool(CFG, kv, dtype=dtype, device=torch.device("cpu"))

    def context_tokens(p: KVPool) -> int:  # past every request's fixed pages, in the CSA group
        g = p.groups["csa"]
        return (g.num_pages - 1 - 4 * (p.ring_pages + 1)) * p.page_size * g.ratio

    plain, quantized = pool(torch.bfloat16, "auto"), pool(torch.bfloat16, "fp8")
    wide = pool(torch.float32, "auto")
    ratio = context_tokens(quantized) / context_tokens(plain)
    assert (context_tokens(quantized), context_tokens(plain)) == (85760, 46336)
    assert bf16 / fp8 <= ratio < 1.9, ratio
    assert context_tokens(quantized) / context_tokens(wide) >= f32 / fp8
    assert quantized.token_capacity() > 1.75 * plain.token_capacity()
    for p in (plain, quantized):  # both spend the budget (and the dummy pages: a page a group)
        assert 0.95 * (32 << 20) < p.arena.nbytes < (32 << 20) + 2 * 64 * 5 * 1024, p.arena.nbytes


def test_pools_of_different_kv_cache_dtypes_do_not_pair(auto, fp8):
    ours, theirs = fp8.engine.pool, auto.engine.pool
    assert ours.layout_hash() != theirs.layout_hash()
    assert "kv_cache_dtype=fp8" in ours.layout_description()
    assert "kv_cache_dtype=float32" in theirs.layout_description()
    # NIXL's own check (a peer's descriptor) refuses them too: the same region, other bytes
    tables = [describe([Region(*r) for r in p.regions()]) for p in (ours, theirs)]
    assert "page bytes here" in first_difference(*tables)


def test_unknown_or_unfit_kv_cache_dtypes_are_refused(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        settings.parse(EngineConfig, ["--kv-cache-dtype", "bogus"], "dsaserve")
    assert "--kv-cache-dtype: invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings.parse(EngineConfig, [], "dsaserve", {"DSASERVE_KV_CACHE_DTYPE": "fp16"})
    assert "DSASERVE_KV_CACHE_DTYPE='fp16': must be one of auto, fp8" in capsys.readouterr().err
    assert settings.parse(EngineConfig, ["--kv-cache-dtype", "fp8"], "x").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="bogus")
    # The tiny test models' 64-wide rows have no FP8 format: refused before any rank starts.
    tiny = make_tiny_model(tmp_path / "tiny")
    with pytest.raises(ValueError, match="this model has head_dim 64 with 16 RoPE dims"):
        LLMEngine(tiny, EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="multiple of 4"):
        LLMEngine(MODEL, EngineConfig(kv_cache_dtype="fp8", page_size=6))


# ---------------------------------------------------------------- DeepSeek-V3.2's own


@families("deepseek_v32")
def test_the_pools_hold_one_latent_row_and_one_index_key_a_token(family, fp8_model):
    cfg = family.package.ModelConfig.from_dir(fp8_model)
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


# ---------------------------------------------------------------- the stack


MESSAGES = [{"role": "user", "content": "Good morrow, cousin."}]


@pytest.mark.e2e
def test_fp8_workers_answer_like_offline_fp8_and_a_bf16_peer_is_refused(redis_url, tmp_path):
    """An FP8 prefill worker pairs with the FP8 decode worker only (NIXL moves the FP8 bytes)
    and the answers are `dsaserve generate --kv-cache-dtype fp8`'s; handed the FP8 worker's KV,
    a decode worker with the model-dtype cache refuses it naming both caches."""
    offline = offline_generate(MODEL, MESSAGES, 16, "--kv-cache-dtype", "fp8")
    s = Stack(MODEL, redis_url, tmp_path)
    try:
        prefill = s.worker("prefill", "--kv-cache-dtype", "fp8")
        decode, other = s.worker("decode", "--kv-cache-dtype", "fp8"), s.worker("decode")
        router = s.router()
        s.wait_ready(prefill, decode, other)
        url = s.wait_healthy(router)
        body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        for _ in range(2):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == offline["text"]
        ok = dict(role="decode", outcome="ok")
        assert decode.counter("dsaserve_worker_requests_total", **ok) == 2
        assert other.counter("dsaserve_worker_requests_total", **ok) == 0

        sampling = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        metadata = token_metadata(TOKEN)
        with grpc.insecure_channel(prefill.address) as channel:
            stub = grpc_api.PrefillStub(channel)
            request = pb.PrefillRequest(
                request_id="cross", prompt_token_ids=list(range(3, 40)), sampling=sampling
            )
            held = stub.Prefill(request, metadata=metadata, timeout=60)
            with grpc.insecure_channel(other.address) as to_other:
                call = grpc_api.DecodeStub(to_other).Decode(
                    pb.DecodeRequest(
                        request_id="cross",
                        prompt_token_ids=list(range(3, 40)),
                        first_token_id=held.first_token_id,
                        sampling=sampling,
                        kv=held.kv,
                    ),
                    metadata=metadata,
                    timeout=60,
                )
                with pytest.raises(grpc.RpcError) as refused:
                    list(call)
            stub.Release(pb.ReleaseRequest(request_id="cross"), metadata=metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = refused.value.details()
        assert "KV layout mismatch" in message and "--kv-cache-dtype" in message, message
        assert "kv_cache_dtype=fp8" in message and "kv_cache_dtype=float32" in message, message
        for worker in (prefill, decode, other):
            wait_for(worker.all_kv_free, 30, f"{worker.name} to free every page and block")
    finally:
        s.stop()
