"""Automatic prefix caching in the engine (engine.prefix_cache.cache): a request resumed from the
cache computes what it computes from zero (fp32 logits within 1e-5, the same greedy tokens) at
every kind of boundary of V4's KV state, reuses what the issue promises, and leaves nothing
behind however the pools, the scheduler and the requests treat it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from bench.compare import rel_err
from bench.numerics import BOS, heldout_windows
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.allocator import PageAllocator
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v32.tiny import make_tiny_model as make_v32
from dsaserve.engine.prefix_cache.block_hash import block_hashes, cache_salt
from dsaserve.engine.prefix_cache.checkpoint import CopyPlan
from dsaserve.engine.request import RequestOutput, Status
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import assert_all_free, byte_ids, drain, move, move_staged
from tests.model_fixtures import families
from tests.release_reference import ENGINE, TOKENS, release_ids

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
FP8_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=96, kv_cache_memory_bytes=48 << 20)
# Release tiny model, 8-token pages: window 16 = the ring; CSA (rate 4) pages close every 32
# tokens, HCA (rate 128) windows every 128 and pages every 1024; blocks of 8 tokens.
BOUNDARIES = [1, 3, 4, 5, 63, 64, 65, 127, 128, 129, 255, 256, 257, 421, 1025]


class Recorder:
    """The fp32 logits of every row an engine samples from, by request (the runner's own
    output, recorded on its way to the sampler)."""

    def __init__(self, engine: LLMEngine, vocab: int = TOKENS) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.vocab = vocab
        execute = engine.runner.execute

        def recording(batch):  # type: ignore[no-untyped-def]
            samplers, counts, logits, prompt_rows = execute(batch)
            for i, req in enumerate(samplers):
                self.rows.setdefault(req.request_id, []).append(logits[i, :vocab].clone())
            return samplers, counts, logits, prompt_rows

        engine.runner.execute = recording  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def served(release) -> Iterator[tuple[LLMEngine, Recorder]]:
    engine = LLMEngine(release, EngineConfig(**ENGINE))
    yield engine, Recorder(engine)


def _run(engine: LLMEngine, rid: str, prompt: list[int], params=GREEDY) -> list[RequestOutput]:
    engine.add_request(rid, prompt, params)
    return drain(engine)[rid]


def _check_against_zero(
    engine: LLMEngine, rec: Recorder, rid: str, prompt: list[int], tolerance: float = 1e-5
) -> int:
    """Serve `prompt`; its sampled rows' logits against a from-zero forward (score); returns
    the cached tokens it reported."""
    outs = _run(engine, rid, prompt)
    tokens = [t for o in outs for t in o.new_token_ids]
    got = torch.stack(rec.rows[rid])
    want = engine.score(prompt + tokens[:-1])[len(prompt) - 1 :, : rec.vocab]
    assert rel_err(got, want) < tolerance, (rid, rel_err(got, want))
    assert tokens == want.argmax(-1).tolist()
    assert {o.cached_tokens for o in outs} == {outs[0].cached_tokens}
    return outs[0].cached_tokens


@pytest.mark.parametrize("length", BOUNDARIES)
def test_a_resumed_request_computes_what_it_computes_from_zero(served, length):
    engine, rec = served
    x, tail = release_ids(length, length), release_ids(6, 10_000 + length)
    assert _check_against_zero(engine, rec, f"first{length}", x) == 0
    answer = torch.stack(rec.rows[f"first{length}"]).argmax(-1).tolist()
    if tail[0] == answer[0]:  # (else it would resume inside the answer's state, below)
        tail[0] = (tail[0] + 1) % TOKENS
    # the next turn extends the prompt: it resumes at its very end
    assert _check_against_zero(engine, rec, f"extends{length}", x + tail) == length
    # the next turn of a conversation: the answer's state was kept when it ended, up to its
    # last token (sampled, never computed)
    turn = x + answer + tail
    assert _check_against_zero(engine, rec, f"turn{length}", turn) == length + len(answer) - 1
    # sent again: one token short of the end (something must be computed to sample)
    assert _check_against_zero(engine, rec, f"again{length}", x) == length - 1
    # the last shared token differs: resumed one short, where that token is recomputed
    other = (x[-1] + 1) % TOKENS
    assert _check_against_zero(engine, rec, f"differs{length}", x[:-1] + [other] + tail) == (
        length - 1
    )


def test_checkpoints_inside_chunks_keep_any_shared_length_within_an_interval(release):
    """Chunks of 300 tokens: the 512- and 1024-token checkpoints fall inside them. A prompt
    sharing L tokens reuses at least L - 512 (here: the checkpoint below L)."""
    engine = LLMEngine(release, EngineConfig(**dict(ENGINE, max_num_batched_tokens=300)))
    rec = Recorder(engine)
    x = release_ids(1300, 1)
    assert _check_against_zero(engine, rec, "first", x) == 0
    for shared, want in (
        (1100, 1024),
        (700, 512),
        (1024, 1024),
        (1025, 1024),
        (511, 511),
        (510, 0),
    ):
        prompt = x[:shared] + release_ids(9, shared)
        assert _check_against_zero(engine, rec, f"share{shared}", prompt) == want
        assert want >= shared - 512
    assert_all_free(engine)


@pytest.mark.parametrize("block_size", [8, 64])
def test_dense_model_at_page_boundaries_and_without_async_scheduling(tiny, block_size):
    engine = LLMEngine(
        tiny, EngineConfig(page_size=block_size, async_scheduling=False, max_num_batched_tokens=100)
    )
    rec = Recorder(engine)
    for length in (63, 64, 65, 255, 256, 257):
        x = byte_ids(length, length)
        assert _check_against_zero(engine, rec, f"a{length}", x) == 0
        assert _check_against_zero(engine, rec, f"b{length}", x + byte_ids(5, 1)) == length
    assert_all_free(engine)


def test_a_prefix_two_prompts_share_is_checkpointed_where_they_part(tiny):
    """A system prompt shorter than the checkpoint interval: the second prompt that shares it
    leaves a checkpoint where the two part, and every later one resumes there."""
    engine = LLMEngine(tiny)
    rec = Recorder(engine, vocab=engine.tokenizer.vocab_size)
    system = byte_ids(300, 30)
    cached = [
        _check_against_zero(engine, rec, f"q{i}", system + byte_ids(20, 31 + i)) for i in range(4)
    ]
    assert cached == [0, 0, 300, 300]
    assert_all_free(engine)


def test_evicted_checkpoints_come_back_from_the_host_tier(tiny):
    """Two checkpoints fit on the device: the rest move to host memory, with the full entry
    pages no device checkpoint needs any more, and come back on a hit. A tier too small for
    all of them drops its oldest."""
    tight = dict(
        page_size=8, max_num_batched_tokens=128, prefix_cache_checkpoint_memory_bytes=180_000
    )
    engine = LLMEngine(tiny, EngineConfig(kv_offloading_size=1 / 1024, **tight))  # 1 MiB
    rec = Recorder(engine, vocab=engine.tokenizer.vocab_size)
    cache, host = engine.prefix_cache, engine.runner.host
    assert cache is not None and host is not None
    prompts = [byte_ids(200, 40 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        assert _check_against_zero(engine, rec, f"p{i}", p) == 0
    assert cache.stats.evictions >= 2 and host.num_free < host.allocator.num_pages
    nodes_on_host = [n for n in _nodes(cache.root) if n.host is not None]
    assert nodes_on_host  # full CSA pages (every 32 tokens here) moved too
    loads = cache.stats.host_loads
    assert _check_against_zero(engine, rec, "back0", prompts[0] + byte_ids(9, 50)) == 200
    assert cache.stats.host_loads == loads + 1
    assert_all_free(engine)
    small = LLMEngine(tiny, EngineConfig(kv_offloading_size=0.25 / 1024, **tight))
    rec = Recorder(small, vocab=small.tokenizer.vocab_size)
    for i, p in enumerate(prompts):
        _check_against_zero(small, rec, f"p{i}", p)
    assert _check_against_zero(small, rec, "gone", prompts[0] + byte_ids(9, 51)) == 0
    assert _check_against_zero(small, rec, "kept", prompts[3] + byte_ids(9, 52)) == 200
    assert_all_free(small)


def test_deepseek_v32_resumes_wherever_a_prompt_parts_from_a_cached_one(tmp_path_factory):
    """V3.2 keeps nothing per position but each token's latent row and index key, so its
    checkpoints own nothing and a request resumes at any shared length: a full block's page is
    shared, the part of a block a prompt shares is copied from a cached page. Chunks of 40 over
    8-token pages; the indexer picks 8 of up to 130 rows."""
    model = make_v32(tmp_path_factory.mktemp("v32"))
    tight = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=40)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory_bytes=8 << 20, **tight))
    assert engine.pool.checkpoint_slab.num_pages == 0  # (checkpoints need no slab rows)
    rec = Recorder(engine, vocab=engine.tokenizer.vocab_size)
    x, turn = byte_ids(100, 60), byte_ids(30, 61)
    assert _check_against_zero(engine, rec, "first", x) == 0
    # the second turn: the whole first prompt, then greedy tokens as an engine without a cache
    assert _check_against_zero(engine, rec, "second", x + turn) == 100
    plain = LLMEngine(model, EngineConfig(enable_prefix_caching=False, **tight))
    want = [t for o in _run(plain, "second", x + turn) for t in o.new_token_ids]
    assert want == torch.stack(rec.rows["second"]).argmax(-1).tolist()
    assert _check_against_zero(engine, rec, "again", x) == 99
    for shared in (5, 40, 77, 125):  # inside a block, at one, past the first prompt's end
        y = (x + turn)[:shared]
        prompt = y + [((x + turn)[shared] + 1) % 256] + byte_ids(6, shared)
        assert _check_against_zero(engine, rec, f"share{shared}", prompt) == shared
    assert_all_free(engine)
    # a pool of 80 pages: older prefixes leave for the host tier and come back on a hit
    small = LLMEngine(
        model, EngineConfig(kv_cache_memory_bytes=600_000, kv_offloading_size=1 / 1024, **tight)
    )
    rec = Recorder(small, vocab=small.tokenizer.vocab_size)
    prompts = [byte_ids(150, 70 + i) for i in range(6)]
    assert [_check_against_zero(small, rec, f"p{i}", p) for i, p in enumerate(prompts)] == [0] * 6
    cache = small.prefix_cache
    assert cache is not None and cache.stats.evictions and not cache.stats.host_loads
    first = [n for n in _nodes(cache.root) if n.end <= 144 and _on_path(n, prompts[0])]
    assert len(first) == 18 and all(n.host is not None for n in first)  # (on the host tier)
    assert _check_against_zero(small, rec, "back", prompts[0] + turn) == 150
    assert all(n.host is None and n.pages for n in first)  # (back on the device)
    assert_all_free(small)


def _on_path(node, tokens: list[int]) -> bool:  # type: ignore[no-untyped-def]
    """Whether `node`'s prefix is the start of `tokens`."""
    while node.parent is not None:
        if tuple(tokens[node.end - len(node.tokens) : node.end]) != node.tokens:
            return False
        node = node.parent
    return True


@families()
def test_a_cache_salt_resumes_only_from_prefixes_computed_under_it(tiny):
    """Namespaces: the same prompt under another cache_salt (or none) computes everything; under
    its own it resumes. V3.2 resumes even inside a cached block's tokens, the case a shared root
    would leak through."""
    model = tiny
    tight = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=40)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory_bytes=8 << 20, **tight))

    def cached(rid: str, prompt: list[int], salt: str | None) -> int:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, cache_salt=salt)
        return _run(engine, rid, prompt, params)[-1].cached_tokens

    x = byte_ids(100, 5)
    assert [cached(f"{s}-1", x, s) for s in ("a", "b", None)] == [0, 0, 0]
    assert [cached(f"{s}-2", x, s) for s in ("a", "b", None)] == [99, 99, 99]
    apart = x[:5] + [(x[5] + 1) % 256] + byte_ids(20, 6)  # parts from x inside its first block
    assert cached("c", apart, "c") == 0
    assert_all_free(engine)


def _nodes(root):  # type: ignore[no-untyped-def]
    stack, out = list(root.children.values()), []
    while stack:
        out.append(stack.pop())
        stack.extend(out[-1].children.values())
    return out


def test_without_prefix_caching_nothing_is_cached(tiny):
    engine = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False))
    x = byte_ids(100, 3)
    for rid in ("a", "b"):
        assert _run(engine, rid, x)[-1].cached_tokens == 0
    assert engine.prefix_cache is None and engine.pool.checkpoint_slab.num_pages == 0
    assert engine.load().cached_pages == 0
    assert_all_free(engine)


def test_a_tiny_pool_evicts_and_still_answers_right(tiny):
    """Many distinct prefixes through a pool that holds a few requests: checkpoints are evicted
    (least recently used first), answers stay those of an engine without the cache."""
    tight = dict(
        kv_cache_memory_bytes=3_000_000,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefix_cache_checkpoint_memory_bytes=440_000,  # five (answers leave some too)
    )
    plain = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False, **tight))
    engine = LLMEngine(tiny, EngineConfig(**tight))
    prompts = [byte_ids(120, s) for s in range(10)]
    prompts += [p + byte_ids(20, 99) for p in prompts[-2:]]  # the latest prefixes come back
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        plain.add_request(str(i), p, params)
    got, want = drain(engine), drain(plain)
    tokens = lambda outs: {k: [t for o in v for t in o.new_token_ids] for k, v in outs.items()}
    assert tokens(got) == tokens(want)
    cache = engine.prefix_cache
    assert cache is not None and cache.stats.evictions > 0
    assert [got[str(i)][-1].cached_tokens for i in range(12)] == [0] * 10 + [120, 120]
    assert_all_free(engine)


def test_pages_a_request_reads_stay_while_the_cache_lets_them_go(tiny):
    """A request resumed from the cache shares full entry pages: emptying the cache while it
    runs drops only the cache's references, and the request still answers right."""
    engine = LLMEngine(tiny, EngineConfig(page_size=8))
    x = byte_ids(300, 5)
    _run(engine, "a", x)
    engine.add_request("b", x + byte_ids(4, 6), SamplingParams(max_tokens=12, temperature=0))
    # (what the first step captured is evictable from the next one on)
    first = engine.step() + engine.step()
    req = engine.scheduler.requests["b"]
    assert req.num_cached_tokens == 300
    cache = engine.prefix_cache
    assert cache is not None
    shared = req.page_tables["csa"][engine.pool.ring_pages : engine.pool.ring_pages + 9]
    cache.clear()
    csa = engine.pool.groups["csa"].allocator
    assert all(csa.refs(p) == (1, 0) for p in shared)  # the request's own reference is left
    outs = first + drain(engine)["b"]
    alone = LLMEngine(tiny, EngineConfig(page_size=8, enable_prefix_caching=False))
    want = _run(alone, "b", x + byte_ids(4, 6), SamplingParams(max_tokens=12, temperature=0))
    assert [t for o in outs for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
    assert_all_free(engine)


def test_requests_with_one_new_prefix_arriving_together_compute_it_once(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_num_batched_tokens=64))
    x = byte_ids(200, 8)
    prompts = {"a": x, "b": x, "c": x + byte_ids(7, 9)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    outs = drain(engine)
    assert outs["a"][0].cached_tokens == 0
    assert outs["b"][0].cached_tokens == 199 and outs["c"][0].cached_tokens == 200
    alone = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False))
    for rid, p in prompts.items():
        want = [t for o in _run(alone, rid, p) for t in o.new_token_ids]
        assert [t for o in outs[rid] for t in o.new_token_ids] == want
    assert_all_free(engine)


def test_aborting_the_request_others_wait_on_lets_them_go_on(tiny):
    """b waits for a's prefix; a is aborted half way: b resumes from what a computed."""
    engine = LLMEngine(
        tiny, EngineConfig(max_num_batched_tokens=64, prefix_cache_checkpoint_interval=64)
    )
    x = byte_ids(300, 11)
    engine.add_request("a", x, GREEDY)
    engine.add_request("b", x + byte_ids(3, 12), GREEDY)
    engine.step()
    engine.step()
    b = engine.scheduler.requests["b"]
    assert b.num_computed == 0 and b in engine.scheduler.waiting  # waiting for a's checkpoints
    assert engine.abort("a")
    outs = drain(engine)["b"]
    assert 0 < outs[0].cached_tokens < 300
    alone = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False))
    want = _run(alone, "b", x + byte_ids(3, 12))
    assert [t for o in outs for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
    assert_all_free(engine)


def test_a_preempted_request_that_shares_pages_gives_back_only_its_own(tiny):
    """`shared` resumes from `warm`'s checkpoint (sharing its full entry pages), is admitted last
    and so preempted when the decodes outgrow the pool (after the cache gave back all it could):
    it is computed again and answers as if never moved; every page comes back."""
    tight = dict(
        kv_cache_memory_bytes=900_000,
        page_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        prefix_cache_checkpoint_memory_bytes=300_000,
    )
    engine = LLMEngine(tiny, EngineConfig(**tight))
    x = byte_ids(160, 13)
    _run(engine, "warm", x, SamplingParams(max_tokens=1, temperature=0))
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    prompts = {"p1": byte_ids(300, 15), "p2": byte_ids(300, 16), "shared": x + byte_ids(2, 14)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, long)
    outs: dict[str, list[RequestOutput]] = {}
    preempted = False
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        req = engine.scheduler.requests.get("shared")
        preempted |= (
            req is not None and req.status is Status.WAITING and bool(req.num_cached_tokens)
        )
    assert preempted and outs["shared"][0].cached_tokens == 160
    alone = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False, max_num_seqs=4))
    for rid, p in prompts.items():
        alone.add_request(rid, p, long)
    want = drain(alone)
    for rid in prompts:
        assert [t for o in outs[rid] for t in o.new_token_ids] == [
            t for o in want[rid] for t in o.new_token_ids
        ], rid
    assert_all_free(engine)


def test_a_resumed_prefill_only_request_moves_to_a_decode_engine_like_any_other(tiny):
    """The disaggregated path: prefill from the cache, staged, pulled, decoded elsewhere."""
    x = byte_ids(150, 17)
    prompt = x + byte_ids(10, 18)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False))
    want = [t for o in _run(alone, "r", prompt, params) for t in o.new_token_ids]
    prefill = LLMEngine(tiny)
    prefill.add_request("warm", x, params, prefill_only=True)
    drain(prefill)
    assert prefill.handoff.release("warm")
    prefill.add_request("r", prompt, params, prefill_only=True)
    (out,) = drain(prefill)["r"]
    assert out.cached_tokens == 150
    held = prefill.handoff.stage("r")
    decode = LLMEngine(tiny, EngineConfig(enable_prefix_caching=False))
    reserved = decode.handoff.reserve("r", prompt, out.new_token_ids[0], params)
    assert reserved is not None
    (blocks,) = held.pages.values()
    move_staged(prefill.pool, blocks, decode.pool, decode.pool.unpacker(reserved.pages))
    decode.handoff.join("r")
    got = out.new_token_ids + [t for o in drain(decode)["r"] for t in o.new_token_ids]
    assert got == want
    assert prefill.handoff.release("r")
    assert_all_free(prefill)
    assert_all_free(decode)


@pytest.mark.parametrize(
    "family, via",
    [("deepseek_v4", "staging"), ("deepseek_v4", "pages"), ("deepseek_v32", "staging")],
    indirect=["family"],
)
def test_a_conversations_next_turn_computes_and_moves_only_its_new_tokens(tiny, via):
    """A decode engine keeps what a turn computed (prompt and answer) when it ends. The next
    turn's prefill engine borrows that state (a loan: the decode engine's checkpoint restored
    into pages it holds, pulled but for the pages the prefill engine's cache holds) and computes
    only the new tokens; the decode engine shares the full pages it kept and moves only the rest
    (the ring pages, the slab row and the entry pages past them). A decode engine that lost the
    conversation (its cache emptied) lends nothing and takes everything. Answers are those of an
    engine that never moved anything; every page comes back. DeepSeek-V3.2 (no per-position
    state, no ring) alike."""
    model = tiny
    config = EngineConfig(page_size=8, max_num_batched_tokens=64)
    prefill, decode = LLMEngine(model, config), LLMEngine(model, config)
    alone = LLMEngine(model, dataclasses.replace(config, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pool, conversation, computed, last_prompt = decode.pool, byte_ids(300, 40), 0, 0
    for turn in range(4):
        rid, lost = f"t{turn}", turn == 3
        if lost:
            assert decode.prefix_cache is not None
            decode.prefix_cache.clear()
        want = [t for o in _run(alone, rid, conversation, params) for t in o.new_token_ids]
        have = prefill.loans.resume_position(conversation, params)
        assert have == last_prompt
        loan = decode.loans.lend("loan", conversation, have)
        assert (loan is not None) == (0 < turn and not lost)
        if loan is not None:
            adopted = prefill.loans.adopt(rid, conversation, params, None, loan.num_tokens)
            assert adopted is not None
            move(decode.pool, loan, prefill.pool, adopted)
            assert decode.handoff.release("loan")
            prefill.loans.start(rid, loan.num_tokens)
        else:
            prefill.add_request(rid, conversation, params, prefill_only=True)
        (out,) = drain(prefill)[rid]
        # the previous turn's prompt and answer (but the answer's last token, sampled and never
        # computed) when the decode engine kept them, else the previous prompt
        assert out.cached_tokens == (have if lost or not turn else computed)
        held = prefill.handoff.stage(rid) if via == "staging" else None
        held = held or prefill.handoff.held_pages(rid)
        reserved = decode.handoff.reserve(rid, conversation, out.new_token_ids[0], params)
        assert reserved is not None
        # the full pages of what the decode engine kept, block by block
        assert reserved.reused_tokens == (0 if lost else computed // 8 * 8)
        moved = move(prefill.pool, held, pool, reserved)
        shared = sum(
            (reserved.reused_tokens // g.ratio) // 8 for g in pool.groups.values() if g.ratio
        )
        assert moved == sum(len(reserved.pages[g]) for g in pool.groups) - shared
        decode.handoff.join(rid)
        got = out.new_token_ids + [t for o in drain(decode)[rid] for t in o.new_token_ids]
        assert got == want
        assert prefill.handoff.release(rid)
        computed, last_prompt = len(conversation) + len(got) - 1, len(conversation)
        conversation = conversation + got + byte_ids(40, 41 + turn)
    for engine in (prefill, decode):
        assert_all_free(engine)


# ---------------------------------------------------------------- the pieces


def test_block_hashes_chain_whole_blocks_under_a_salt():
    salt = cache_salt("model", "layout")
    a = block_hashes(list(range(20)), salt, 8)
    assert len(a) == 2 and len(set(a)) == 2
    assert block_hashes(list(range(16)) + [99] * 4, salt, 8) == a  # the partial block is not hashed
    assert block_hashes(list(range(20)), salt, 8, a[:1]) == a  # resumes from known hashes
    assert block_hashes([1] + list(range(1, 20)), salt, 8)[1] != a[1]  # chained: block 0 matters
    assert block_hashes(list(range(20)), cache_salt("other"), 8)[0] != a[0]


def test_the_allocator_counts_pages_only_the_cache_holds():
    alloc = PageAllocator(6)
    mine = alloc.allocate(2, cached=True)
    theirs = alloc.allocate(2)
    assert alloc.num_cached == 2
    alloc.incref(mine[:1])  # a request shares one of the cache's pages
    assert alloc.num_cached == 1 and alloc.refs(mine[0]) == (2, 1)
    alloc.incref(theirs[:1], cached=True)  # the cache takes one of the request's
    alloc.free(theirs[:1])
    assert alloc.num_cached == 2
    alloc.free(mine[:1])
    alloc.free(mine, cached=True)
    alloc.free(theirs[:1], cached=True)
    assert alloc.num_cached == 0 and alloc.num_free == 5
    with pytest.raises(AssertionError, match="the cache holds no page"):
        alloc.free(theirs[1:], cached=True)


def test_a_copy_plan_reads_what_an_earlier_copy_wrote_from_its_source():
    plan = CopyPlan()
    plan.add({"g": [1, 2], "slab": [7]}, {"g": [3, 4], "slab": [8]})
    plan.add({"g": [3], "slab": [8]}, {"g": [5], "slab": [9]})
    assert plan.src == {"g": [1, 2, 1], "slab": [7, 7]}
    assert plan.dst == {"g": [3, 4, 5], "slab": [8, 9]}


def test_fp8_pages_resume_as_they_were_written():
    """--kv-cache-dtype fp8 on the demo model (512-wide rows): checkpoints copy the FP8 pages'
    bytes (a row's data and scales lie apart in its page), so a resumed request reads the rows
    a from-zero run writes. (Within 5e-5, measured 9e-6: rows computed in another chunk shape
    may round to a neighbouring FP8 code; the first request, cache or not, shows 2e-6.)"""
    engine = LLMEngine(DEMO_MODEL_DIR, EngineConfig(kv_cache_dtype="fp8", **FP8_ENGINE))
    rec = Recorder(engine, vocab=engine.tokenizer.vocab_size)
    x = [BOS, *heldout_windows(1, 512)[0][:300]]
    assert _check_against_zero(engine, rec, "first", x, tolerance=5e-5) == 0
    assert _check_against_zero(engine, rec, "next", x + x[1:40], tolerance=5e-5) == len(x)
    assert _check_against_zero(engine, rec, "again", x, tolerance=5e-5) == len(x) - 1
    assert_all_free(engine)


@pytest.mark.e2e
def test_two_ranks_resume_from_the_same_pages(release):
    """Tensor parallel: rank 0 plans every restore and checkpoint, each rank copies its own pools
    (the same page ids): two ranks resume as one computes from zero."""
    x, tail = release_ids(300, 21), release_ids(7, 22)
    one = LLMEngine(release, EngineConfig(enable_prefix_caching=False, **ENGINE))
    want = [
        [t for o in _run(one, rid, p) for t in o.new_token_ids]
        for rid, p in (("a", x), ("b", x + tail))
    ]
    engine = LLMEngine(release, EngineConfig(tensor_parallel_size=2, **ENGINE))
    try:
        rec = Recorder(engine)
        got = []
        for rid, p in (("a", x), ("b", x + tail)):
            outs = _run(engine, rid, p)
            got.append([t for o in outs for t in o.new_token_ids])
            logits = one.score(p + got[-1][:-1])[len(p) - 1 :, :TOKENS]
            assert rel_err(torch.stack(rec.rows[rid]), logits) < 1e-5
        assert got == want and outs[0].cached_tokens == 300
        assert_all_free(engine)
    finally:
        engine.close()
