"""Synthetic history: requests that decode as if T tokens of context were already computed.

Written the way a disaggregated decode worker receives a prefilled request (`Handoff.reserve`,
a "transfer" into the reserved pages, `Handoff.join`), so no prefill runs and the requests
are the engine's own: scheduled, grown, sampled and freed as any other. The transfer writes
random values into the request's pages and slab row (KV rows, compressed entries, indexer keys,
compressor rings): what a decode step costs does not depend on them. Regions whose dtype is not
a float (quantized formats) keep zeros, which decode to finite values in any format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dsaserve.engine.config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from dsaserve.engine.kv.layout import STAGING
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.sampling_params import SamplingParams

_RANDOM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HistoryError(ValueError):
    """The engine cannot hold the requested history; the message says what to change."""


def fill_random(
    pool: KVPool, pages: Mapping[str, Sequence[int]], generator: torch.Generator
) -> None:
    """Random values in these pages of every region (pages: group -> page ids, the slab row
    under "slab", as `Handoff.reserve` returns them)."""
    for region in pool.regions():
        ids = pages.get(region.group)
        if region.group == STAGING or not ids or region.tensor.dtype not in _RANDOM_DTYPES:
            continue
        t = region.tensor
        index = torch.tensor(ids, dtype=torch.int64, device=t.device)
        values = torch.empty((len(ids), *t.shape[1:]), dtype=t.dtype, device=t.device)
        t.index_copy_(0, index, values.normal_(0, 1, generator=generator))


def tokens_needed(context: int, steps: int) -> int:
    """Tokens one request holds after `steps` decode steps from `context` tokens (and the
    token sampled by its prefill, which the first step consumes)."""
    return context + steps + 1


def check(n: int, context: int, steps: int, max_model_len: int, config: EngineConfig) -> None:
    """Whether an engine with these limits can run n requests of `context` tokens for `steps`
    decode steps, all in every step (HistoryError: what to change); known before the engine is
    built."""
    if tokens_needed(context, steps) > max_model_len:
        raise HistoryError(
            f"--context {context} leaves too little room within the max-model-len "
            f"{max_model_len} for the {steps} decode steps the profile runs (--context "
            f"{max_model_len - steps - 1} at most); lower --context or --steps, or raise "
            "--max-model-len"
        )
    seqs = config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    if n > seqs:
        raise HistoryError(
            f"--concurrency {n} is more requests than --max-num-seqs {seqs} lets hold KV at "
            "once; raise --max-num-seqs (or --kv-cache-memory-bytes, where the budget lowered it)"
        )
    if n > config.max_num_batched_tokens:
        raise HistoryError(
            f"--concurrency {n} is more rows than one step computes (--max-num-batched-tokens "
            f"{config.max_num_batched_tokens}); raise --max-num-batched-tokens"
        )


def add_decoding_requests(
    engine: LLMEngine, n: int, context: int, steps: int, seed: int = 0
) -> list[str]:
    """n requests, each with `context` tokens of history in the KV cache and its first
    sampled token, joined to the running batch, with room for `steps` decode steps each: the
    pages they grow into are free, so no step preempts another request. Their ids."""
    check(n, context, steps, engine.max_model_len, engine.config)
    pool = engine.pool
    for g, group in pool.groups.items():
        need, free = n * pool.pages_for(g, tokens_needed(context, steps)), group.allocator.num_free
        if need > free:
            raise HistoryError(
                f"{n} requests of {tokens_needed(context, steps)} tokens need {need} pages of "
                f"the {g!r} KV pool, which has {free} free; lower --concurrency or --context, "
                "or give the engine more KV memory (--kv-cache-memory-bytes)"
            )
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    generator = torch.Generator(engine.device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (n,), generator=host).tolist()
    # Sampled, not greedy: requests that draw different tokens route to different experts.
    params = SamplingParams(max_tokens=steps + 1, temperature=1.0, ignore_eos=True)
    ids = []
    for i in range(n):
        request_id = f"profile-{i}"
        prompt = [first[(i + 1) % n]] * context
        kv = engine.handoff.reserve(request_id, prompt, first[i], params)
        if kv is None:  # (checked above: only a concurrent user of the engine gets here)
            raise HistoryError(f"no free KV pages for request {i} of {n}")
        fill_random(pool, kv.pages, generator)
        engine.handoff.join(request_id)  # (on every rank of a tensor-parallel group)
        ids.append(request_id)
    return ids


def finish(engine: LLMEngine, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        engine.abort(request_id)
