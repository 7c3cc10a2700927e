"""Speculative decoding (engine.speculative) with either draft head, the MTP layer (the demo
model's) and DSpark (the demo model with its DSpark head): the flag, the start-up checks, greedy
output token for token as without it (chunked prefill, preemption, stop strings, EOS and
max_tokens inside an accepted run, prefix-cache hits, a request moved between engines), the
head's state in the pools, rejection sampling's distribution, seeds, logprobs, aborts; DSpark's
confidence-scheduled verification."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_DSPARK_MODEL_DIR, DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import SLAB
from dsaserve.engine.llm import LLM
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampler import probabilities
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.speculative.config import SpeculativeConfig
from dsaserve.engine.speculative.verify import accepted_tokens, verify_rows
from tests import REPO_ROOT
from tests.engine_cases import (
    assert_all_free,
    check_moved_request_decodes_as_if_never_moved,
    drain,
)

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _heldout(n: int, length: int) -> list[list[int]]:
    """n prompts of held-out Shakespeare bytes (the demo model's tokens are bytes)."""
    text = (REPO_ROOT / "data" / "tinyshakespeare.txt").read_bytes()
    start = len(text) - int(len(text) * 0.05)
    return [[256, *text[start + 997 * i : start + 997 * i + length]] for i in range(n)]


PROMPTS = _heldout(3, 32)


def _spec(k: int, method: str = "mtp", **extra: object) -> str:
    return json.dumps({"method": method, "num_speculative_tokens": k, **extra})


# each draft head: the checkpoint that carries it, the drafts per step its tests use
HEADS = {"mtp": (DEMO_MODEL_DIR, 2), "dspark": (DEMO_DSPARK_MODEL_DIR, 5)}


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Each request's tokens, the groups they came out in (one per step), finish reasons."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = drain(engine)
    groups = [[o.new_token_ids for o in out[str(i)]] for i in range(len(prompts))]
    tokens = [[t for g in gs for t in g] for gs in groups]
    reasons = [out[str(i)][-1].finish_reason for i in range(len(prompts))]
    return tokens, groups, reasons


ENGINE = dict(max_num_seqs=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy continuations of PROMPTS without speculation (both demo checkpoints have the same
    main model)."""
    engine = LLMEngine(DEMO_MODEL_DIR, EngineConfig(**ENGINE))
    return _run(engine, PROMPTS, GREEDY)[0]


# ---------------------------------------------------------------- the flag and its checks


def test_speculative_config_is_vllms_json_and_refuses_what_it_cannot_do():
    assert SpeculativeConfig.parse(None) is None
    got = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}')
    assert got == SpeculativeConfig("mtp", 3)
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1})
    for bad, field in (
        ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
        ({"method": "mtp", "num_speculative_tokens": 5}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": 3}, "model"),
        ({"method": "mtp", "num_speculative_tokens": 1, "k": 1}, "unknown"),
        ({"method": "dspark", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "dspark", "draft_sample_method": "probabilistic"}, "draft_sample_method"),
    ):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="not JSON"):
        EngineConfig(speculative_config="{method: mtp}")
    # DSpark's gamma defaults to the checkpoint's block size (0 until resolved at start);
    # vLLM's name for confidence-scheduled verification is taken too
    dspark = SpeculativeConfig.parse({"method": "dspark", "enable_adaptive_verification": True})
    assert dspark == SpeculativeConfig("dspark", 0, adaptive=True)


def test_a_checkpoint_that_cannot_draft_is_refused_at_start(tmp_path, tiny):
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        LLMEngine(tiny, EngineConfig(speculative_config=_spec(1)))
    # config.json declares the MTP layer but the weights lack it (HF's save_pretrained drops it)
    stripped = tmp_path / "no-mtp"
    stripped.mkdir()
    for f in DEMO_MODEL_DIR.iterdir():
        (stripped / f.name).write_bytes(f.read_bytes())
    weights = load_file(stripped / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")},
              stripped / "model.safetensors")  # fmt: skip
    with pytest.raises(ConfigError, match="stores no MTP tensors"):
        LLMEngine(stripped, EngineConfig(speculative_config=_spec(1), **ENGINE))


def test_a_head_asked_for_by_the_wrong_method_is_refused_naming_what_was_found(tmp_path):
    """mtp on a DSpark checkpoint (whose config also says num_nextn_predict_layers, as
    V4-Flash-0731's does), dspark on an MTP one, a block longer than the head's, a standalone
    drafter, and a `speculators` DSpark drafter (slot j predicts anchor + j): refused at start."""
    with pytest.raises(ConfigError, match="draft head is DSpark .*dspark_block_size"):
        LLMEngine(DEMO_DSPARK_MODEL_DIR, EngineConfig(speculative_config=_spec(1), **ENGINE))
    with pytest.raises(ConfigError, match="no DSpark head.*MTP layer: use method 'mtp'"):
        LLMEngine(DEMO_MODEL_DIR, EngineConfig(speculative_config=_spec(2, "dspark"), **ENGINE))
    with pytest.raises(ConfigError, match="blocks of at most 5"):
        LLMEngine(
            DEMO_DSPARK_MODEL_DIR, EngineConfig(speculative_config=_spec(6, "dspark"), **ENGINE)
        )
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
    with pytest.raises(ConfigError, match="speculators.*slot j predicts anchor \\+ j"):
        LLMEngine(
            DEMO_DSPARK_MODEL_DIR,
            EngineConfig(speculative_config=_spec(5, "dspark", model=str(drafter)), **ENGINE),
        )
    (drafter / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="standalone drafters are not served"):
        LLMEngine(
            DEMO_DSPARK_MODEL_DIR,
            EngineConfig(speculative_config=_spec(5, "dspark", model=str(drafter)), **ENGINE),
        )
    # the checkpoint's config declares a DSpark head its weights lack
    stripped = tmp_path / "no-head"
    stripped.mkdir()
    for f in DEMO_DSPARK_MODEL_DIR.iterdir():
        (stripped / f.name).write_bytes(f.read_bytes())
    weights = load_file(stripped / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")},
              stripped / "model.safetensors")  # fmt: skip
    with pytest.raises(ConfigError, match="stores no DSpark head tensors"):
        LLMEngine(stripped, EngineConfig(speculative_config=_spec(5, "dspark"), **ENGINE))
    # served without speculation, the head is neither built nor read
    assert LLMEngine(stripped, EngineConfig(**ENGINE)).model.dspark is None


# ---------------------------------------------------------------- greedy: the same tokens


@pytest.mark.parametrize(
    "method, k",
    [("mtp", 1), ("mtp", 2), ("mtp", 3)] + [("dspark", g) for g in range(1, 6)],
)
def test_greedy_tokens_equal_those_without_speculation(reference, method, k):
    """Chunked prefill (12 rows a step, so drafts are cut by the budget too, and DSpark's blocks
    of several requests take several passes); the draft head's KV state lives in the pools and
    is freed with each request."""
    engine = LLMEngine(
        HEADS[method][0],
        EngineConfig(speculative_config=_spec(k, method), max_num_batched_tokens=12, **ENGINE),
    )
    draft_layer = engine.model_config.num_layers
    assert draft_layer in engine.pool.group_of_layer  # its window ring (and MTP's pages, rings)
    tokens, groups, _ = _run(engine, PROMPTS, GREEDY)
    assert tokens == reference
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and max(len(g) for gs in groups for g in gs) > 1
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert_all_free(engine)


@pytest.mark.parametrize("method", HEADS)
def test_ends_inside_an_accepted_run_are_where_they_would_be(method):
    """EOS (a stop token id), a stop string and max_tokens falling inside a run of accepted
    drafts (not at its last token) end the request exactly where it ends without speculation."""
    plain = LLM(DEMO_MODEL_DIR, **ENGINE)
    spec = LLM(HEADS[method][0], speculative_config=_spec(3, method), **ENGINE)
    long = SamplingParams(max_tokens=24, temperature=0)
    want = plain.generate([PROMPTS[0]], long)[0].token_ids
    _, groups, _ = _run(spec.engine, PROMPTS[:1], long)
    inside, at = [], 0  # positions inside a step's emitted run, before its last token
    for group in groups[0]:
        inside += range(at + 1, at + len(group) - 1)
        at += len(group)

    def first_time(cut: int) -> bool:  # its token, and its text with the token before, new
        text = bytes(want[: cut + 1]).decode("latin-1")
        return want.index(want[cut]) == cut and text.index(text[-2:]) == cut - 1

    cut = next((c for c in inside if first_time(c)), None)
    assert cut is not None, f"no accepted run to end inside: {groups[0]}"
    cases = [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[want[cut]]),
        SamplingParams(max_tokens=cut + 1, temperature=0),
        SamplingParams(
            max_tokens=24, temperature=0, stop=[bytes(want[cut - 1 : cut + 1]).decode("latin-1")]
        ),
    ]
    expected = plain.generate([PROMPTS[0]] * 3, cases)
    for got, exp in zip(spec.generate([PROMPTS[0]] * 3, cases), expected, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (
            exp.token_ids,
            exp.text,
            exp.finish_reason,
        )
    assert expected[0].token_ids == expected[1].token_ids == want[: cut + 1]


def test_preempted_requests_redraft_and_keep_their_tokens(reference):
    """A pool too small for the batch preempts requests (their MTP state goes with their
    pages); greedy tokens stay those of a roomy pool."""
    cfg = EngineConfig(
        speculative_config=_spec(2),
        kv_cache_memory_bytes=5_600_000,
        page_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        kv_staging_memory_bytes=0,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(DEMO_MODEL_DIR, cfg)
    longer = SamplingParams(max_tokens=32, temperature=0)
    most = longer.max_tokens + 2 * 2  # (and the rows its drafts and the MTP layer write)
    need = sum(engine.pool.pages_for("csa", len(p) + most) for p in PROMPTS)
    assert need > engine.pool.groups["csa"].num_pages - 1, "the pool must be too small"
    tokens, _, _ = _run(engine, PROMPTS, longer)
    assert engine.scheduler.num_preemptions > 0
    assert [t[: GREEDY.max_tokens] for t in tokens] == reference  # (greedy: a longer run
    # extends the shorter)
    assert_all_free(engine)


def test_a_preempted_dspark_request_writes_its_context_again(reference):
    """A request preempted while it has drafts (what a full pool does to the newest request)
    loses its pages, the draft layers' context rings with them, and its drafts; re-admitted,
    its prefill writes the context again and it drafts on: greedy tokens as without
    speculation, drafts accepted after the preemption too."""
    engine = LLMEngine(
        DEMO_DSPARK_MODEL_DIR, EngineConfig(speculative_config=_spec(5, "dspark"), **ENGINE)
    )
    engine.add_request("0", PROMPTS[0], GREEDY)
    req = engine.scheduler.requests["0"]
    while len(req.output_token_ids) < 4 or not req.draft_token_ids:
        engine.step()
    engine.scheduler._preempt(req)  # (Scheduler._grow_or_preempt's victim, chosen here)
    assert not req.draft_token_ids and not req.page_tables
    accepted = engine.speculator.stats.num_accepted_tokens
    out = drain(engine)
    assert req.output_token_ids == reference[0]
    assert out["0"][-1].finished and engine.speculator.stats.num_accepted_tokens > accepted
    assert_all_free(engine)


@pytest.mark.parametrize("method", HEADS)
def test_an_aborted_request_with_drafts_frees_everything(method):
    model, k = HEADS[method]
    engine = LLMEngine(model, EngineConfig(speculative_config=_spec(k, method), **ENGINE))
    engine.add_request("a", PROMPTS[0], GREEDY)
    while not engine.scheduler.requests["a"].draft_token_ids:
        engine.step()
    assert engine.abort("a")
    assert_all_free(engine)


def test_the_layout_names_the_draft_head_and_its_spare_rows():
    plain = LLMEngine(DEMO_MODEL_DIR, EngineConfig(**ENGINE)).pool
    spec = LLMEngine(DEMO_MODEL_DIR, EngineConfig(speculative_config=_spec(2), **ENGINE)).pool
    assert plain.layout_hash() != spec.layout_hash()
    assert spec.layout()["mtp_layer_types"] == ["sliding_attention"]
    assert spec.ring_len >= plain.ring_len + 2
    dspark = LLMEngine(
        DEMO_DSPARK_MODEL_DIR, EngineConfig(speculative_config=_spec(2, "dspark"), **ENGINE)
    ).pool
    layers = dspark.layout()["mtp_layer_types"]
    assert dspark.layout()["draft_head"] == "dspark" and layers == ["sliding_attention"] * len(
        layers
    )
    assert dspark.layout_hash() not in (plain.layout_hash(), spec.layout_hash())


# ---------------------------------------------------------------- sampled requests


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
DRAWS = 20_000
# chi-square's 0.999 quantiles by degrees of freedom
CHI2_P999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the distribution was emitted"
    want = probs[keep] * counts.sum()
    return float(((counts[keep] - want) ** 2 / want).sum())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.8)],
    ids=["t1", "top_p"],
)
@pytest.mark.parametrize("draft", [0, 3, 5])
def test_rejection_sampling_emits_the_target_distribution(params, draft):
    """Row 0 of a request that drafted `draft` emits the draft if accepted, else a residual
    draw: either way distributed as the sampler's own distribution (chi-square at p = 0.001,
    fixed seeds)."""
    torch.manual_seed(0)
    probs = probabilities(LOGITS[None], [params])[0]
    rows = LOGITS.expand(DRAWS, -1).clone()
    accepted, tokens = verify_rows(rows, [draft] * DRAWS, [params] * DRAWS, [0] * DRAWS)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).float()
    df = int((probs > 0).sum()) - 1
    assert _chi2(counts, probs) < CHI2_P999[df], (counts / DRAWS, probs)
    assert abs(accepted.float().mean() - probs[draft]) < 0.015


def test_accepted_tokens_stop_at_the_first_rejection():
    assert accepted_tokens([5, 6, 7], [True, False, True], [9, 8, 4, 3]) == [5, 8]
    assert accepted_tokens([5, 6], [True, True], [9, 8, 4]) == [5, 6, 4]
    assert accepted_tokens([], [], [2]) == [2]


def test_seeded_requests_reproduce_and_logprobs_follow_accepted_tokens():
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7, logprobs=1)
    llm = LLM(DEMO_MODEL_DIR, speculative_config=SPEC, **ENGINE)
    alone = llm.generate([PROMPTS[0]], seeded)[0]
    together = llm.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, seeded])[1]
    assert alone.token_ids == together.token_ids
    assert alone.logprobs is not None and len(alone.logprobs) == len(alone.token_ids)
    # greedy: one logprob per emitted token, each the one the plain engine reports for it
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
    spec = llm.generate([PROMPTS[2]], greedy)[0]
    plain = LLM(DEMO_MODEL_DIR, **ENGINE).generate([PROMPTS[2]], greedy)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.logprobs is not None and plain.logprobs is not None
    assert len(spec.logprobs) == len(spec.token_ids)
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4


def test_adaptive_draft_length_follows_acceptance_and_step_cost():
    """Rows nearly free (a weight-bound step): all K drafts; rows that cost as much as the
    step's fixed part and a low acceptance: none (SGLang's "MTP off at high concurrency")."""
    from dsaserve.engine.speculative.adaptive import DraftLength
    from dsaserve.engine.speculative.stats import SpecDecodeStats

    spec = SpeculativeConfig("mtp", 3, adaptive=True)
    cheap, dear = DraftLength(spec), DraftLength(spec)
    for rows in (1, 4, 16, 64):
        cheap.time_target(rows, 0.010 + 0.00001 * rows)
        cheap.time_draft(rows, 0.002 + 0.00001 * rows)
        dear.time_target(rows, 0.001 + 0.001 * rows)
        dear.time_draft(rows, 0.001 + 0.001 * rows)
    stats = SpecDecodeStats(3)
    assert cheap.choose(1, stats) == 3
    for _ in range(30):  # drafts offered at every position, a fifth of the first accepted
        stats.record(3, 1)
        stats.record(3, 0), stats.record(3, 0), stats.record(3, 0), stats.record(3, 0)
    assert dear.choose(64, stats) == 0
    assert DraftLength(SpeculativeConfig("mtp", 2)).choose(64, stats) == 2  # (not adaptive)


@pytest.mark.parametrize("method", HEADS)
def test_prefix_cache_hits_resume_the_draft_head_too(method):
    """With every default (the prefix cache on, the default KV budget, which holds fewer
    sequences with speculation's spare ring rows: max_num_seqs lowered, not a refusal), a
    prompt that resumes from a checkpoint gets the draft head's state from it too (MTP's
    layer, DSpark's context rings): tokens as without speculation, and drafts accepted."""
    shared = PROMPTS[0] + PROMPTS[1][1:]
    prompts = [shared, shared + PROMPTS[2][1:9]]
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = LLM(DEMO_MODEL_DIR)
    model, k = HEADS[method]
    spec = LLM(model, speculative_config=_spec(k, method))
    assert 1 < spec.engine.config.max_num_seqs < plain.engine.config.max_num_seqs
    for prompt in prompts:  # one after the other: the second resumes from the first's
        want = plain.generate([prompt], params)[0].token_ids
        assert spec.generate([prompt], params)[0].token_ids == want
    cache = spec.engine.prefix_cache
    assert cache is not None and cache.stats.hits > 0
    assert spec.engine.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec.engine)


@pytest.mark.parametrize("method", HEADS)
@pytest.mark.parametrize("via", ["staging", "pages"])
def test_a_moved_request_verifies_the_prefill_engines_drafts_at_its_first_step(via, method):
    """Disaggregated: the prefill engine drafts after the first token as one engine does (MTP:
    its pass over the prompt; DSpark: the context its prompt steps wrote, then a block), the
    drafts (and DSpark's confidences) travel with the KV (KVPages) and the decode engine's
    first step verifies them: the tokens, and every speculation count, those of the request
    never moved."""
    model, k = HEADS[method]
    config = EngineConfig(speculative_config=_spec(k, method), **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    groups = {"swa", "csa", "hca", SLAB}
    check_moved_request_decodes_as_if_never_moved(model, config, PROMPTS[0], via, groups, params)


def test_drafts_a_decode_engine_cannot_verify_are_refused():
    engine = LLMEngine(DEMO_MODEL_DIR, EngineConfig(speculative_config=_spec(2), **ENGINE))
    params = SamplingParams(max_tokens=8, temperature=0)
    for drafts in ([1, 2, 3], [-1], [engine.tokenizer.vocab_size]):
        with pytest.raises(RequestError, match="draft token ids"):
            engine.handoff.reserve("r", PROMPTS[0], 65, params, draft_token_ids=drafts)
    assert "r" not in engine.scheduler.requests
    assert_all_free(engine)


@pytest.mark.e2e  # two ranks as processes
@pytest.mark.parametrize("method", HEADS)
def test_a_tensor_parallel_group_speculates_what_one_rank_decodes(reference, method):
    """TP=2: rank 0 verifies and drafts, its follower runs every draft pass with it (the
    runner's calls reach both ranks); the greedy tokens are those without speculation."""
    model, k = HEADS[method]
    spec = _spec(k, method)
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as two:
        got = [r.token_ids for r in two.generate(PROMPTS, GREEDY)]
        assert got == reference
        assert two.engine.speculator.stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- DSpark: verify by confidence


def test_verify_lengths_follow_each_requests_confidence_and_the_step_cost():
    """Rows nearly free: every draft; rows dear: only the drafts likely enough to pay for their
    row, per request (a confident request verifies more than a doubtful one), down to none;
    without a confidence head, the measured acceptance stands in for it."""
    from dsaserve.engine.speculative.adaptive import DraftLength
    from dsaserve.engine.speculative.stats import SpecDecodeStats

    spec = SpeculativeConfig("dspark", 5, adaptive=True)
    cheap, dear = DraftLength(spec), DraftLength(spec)
    for rows in (4, 8, 16, 64):
        cheap.time_target(rows, 0.010 + 0.00001 * rows)
        cheap.time_draft(rows, 0.002 + 0.00001 * rows)
        dear.time_target(rows, 0.004 + 0.001 * rows)
        dear.time_draft(rows, 0.002 + 0.0001 * rows)
    stats = SpecDecodeStats(5)
    sure, unsure = [0.99, 0.95, 0.9, 0.9, 0.9], [0.3, 0.2, 0.1, 0.1, 0.1]
    free = cheap.verify_lengths([sure, unsure], 2, stats)
    got = dear.verify_lengths([sure, unsure], 2, stats)
    assert free[0] == 5 and free[1] >= 3, free  # (until a draft's chance is ~ 0.002)
    assert got[0] > got[1] == 0 and free[1] > got[1], got
    assert dear.verify_lengths([[0.01] * 5], 1, stats) == [0]
    assert len(dear.verify_lengths([[]], 1, stats)) == 1  # (the measured c_i)
    fixed = DraftLength(SpeculativeConfig("dspark", 5))
    assert fixed.verify_lengths([unsure], 64, stats) == [5]  # (not adaptive: the block)


def test_confidence_scheduled_dspark_keeps_greedy_tokens_and_verifies_fewer_rows(reference):
    """ "adaptive": each step verifies a prefix of each request's block chosen by its
    confidences (here with a cost curve that makes rows dear): the tokens are those without
    speculation, and the drafts verified fewer than a fixed block's."""
    from dsaserve.engine.speculative.adaptive import _Line

    engine = LLMEngine(
        DEMO_DSPARK_MODEL_DIR,
        EngineConfig(speculative_config=_spec(5, "dspark", adaptive=True), **ENGINE),
    )
    length = engine.speculator.length
    # a cost curve of dear rows (a fifth of the step's fixed part each), not timed: at 3
    # requests a draft is verified where its chance of being emitted is over ~0.4
    length.target, length.draft = _Line(), _Line()
    for rows in (1, 64):
        length.target.add(rows, 0.01 + 0.0022 * rows)
        length.draft.add(rows, 0.001)
    length.time_target = length.time_draft = lambda rows, seconds: None  # type: ignore
    tokens, _, _ = _run(engine, PROMPTS, GREEDY)
    assert tokens == reference
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens < 5 * stats.num_drafts  # some blocks cut short
    assert stats.drafts_per_pos[0] >= stats.drafts_per_pos[-1]
    assert_all_free(engine)


@pytest.mark.parametrize("method", HEADS)
def test_the_fp8_kv_cache_holds_the_draft_heads_state_too(method):
    """--kv-cache-dtype fp8: the draft layers' rows (MTP's, DSpark's context) are stored in the
    584-byte FP8 rows like every layer's; greedy tokens are those of the FP8 engine without
    speculation, and drafts are accepted."""
    model, k = HEADS[method]
    fp8 = dict(ENGINE, kv_cache_dtype="fp8")
    want = LLM(DEMO_MODEL_DIR, **fp8).generate(PROMPTS[:2], GREEDY)
    spec = LLM(model, speculative_config=_spec(k, method), **fp8)
    got = spec.generate(PROMPTS[:2], GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.speculator.stats.num_accepted_tokens > 0
