"""What makes the engine refuse a request before it is queued: each check raises a RequestError
with the reason (the services turn it into a 400 / INVALID_ARGUMENT), so nothing of the request
is ever allocated or computed."""

from __future__ import annotations

from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampling_params import SamplingParams


def check_token_ids(prompt_token_ids: list[int], params: SamplingParams, vocab: int) -> None:
    """Every token id of the prompt and of the sampling parameters is in [0, vocab) (vocab: the
    smaller of the embedding's rows and the tokenizer's: a padded embedding's rows are no
    tokens); the prompt is not empty."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    bad = [t for t in params.token_ids_in_use() if not 0 <= t < vocab]
    if bad:
        raise RequestError(
            f"token ids of stop_token_ids, logit_bias and allowed_token_ids must be in "
            f"[0, {vocab}); got {bad[:5]}"
        )


def check_fits(pool: KVPool, needed_tokens: int) -> None:
    """A request of `needed_tokens` computed tokens fits every KV pool when it has it alone."""
    for g, group in pool.groups.items():
        need, have = pool.pages_for(g, needed_tokens), group.num_pages - 1
        if need > have:
            raise RequestError(
                f"{needed_tokens} tokens need {need} pages of the {g!r} KV pool, which has "
                f"{have}; lower max_tokens or give the worker more KV memory "
                "(--kv-cache-memory-bytes)"
            )
