"""The prefix cache across the handoff: a prefill worker borrows from a decode worker's cache.

A decode worker keeps what a conversation's turn computed when it ends, its prompt and its
answer (`PrefixCache.keep`); the prefill worker that computes the next turn never computed the
answer, so its own cache resumes at the last prompt's end. Rather than compute the answer again
it borrows the state after it:
- `lend` (the decode worker): the state of the longest prefix of a prompt its cache resumes,
  restored from the checkpoint into pages of a loan (a held request, as a prefill worker holds a
  prompt), when it reaches past what the borrower's own cache resumes. `Handoff.release` ends it.
- `adopt` (the prefill worker): a prefill-only request with pages for its prompt, the full
  entry pages of the prefix its own cache holds shared (the transfer skips those:
  KVPool.missing); the transfer fills the rest of the lent prefix; `start` then has it compute
  only the tokens after it, and its end-of-prompt checkpoint registers the borrowed pages in
  this cache too.
The transfer (a page READ) and the loan's lease are the services' (services.prefill.borrow).
"""

from __future__ import annotations

from dsaserve.engine.handoff import Handoff, copy_now
from dsaserve.engine.request import KVPages, Listener
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.structured import GrammarState

PROBE_ID = "__resume_position__"  # (a request built to look up, never queued)


class Loans:
    def __init__(self, handoff: Handoff) -> None:
        self.handoff, self.cache = handoff, handoff.prefix_cache
        self.scheduler, self.new_request = handoff.scheduler, handoff.new_request

    def lend(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        have: int,
        cache_salt: str | None = None,
    ) -> KVPages | None:
        """Hold for a reader the state of the longest prefix of the prompt this cache resumes
        in the namespace `cache_salt` (at most all but its last token), in pages of a loan of
        its own, when it reaches past `have` tokens; None when it does not, or without room."""
        if self.cache is None:
            return None
        params = SamplingParams(max_tokens=1, cache_salt=cache_salt)
        loan = self.new_request(request_id, prompt_token_ids, params, prefill_only=True)
        plan = self.cache.begin_step()
        hit = self.cache.lookup(loan)
        lent = hit is not None and hit.position > have and self.scheduler.lend(loan, hit, plan)
        copy_now(self.handoff.runner, plan)  # (the restore, before the reader's READ)
        if not lent:
            return None
        return KVPages(loan.kv_pages(), loan.num_computed)

    def resume_position(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """How far this cache resumes a prompt now (0: not at all)."""
        if self.cache is None:
            return 0
        hit = self.cache.lookup(self.new_request(PROBE_ID, prompt_token_ids, params))
        return hit.position if hit is not None else 0

    def adopt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        listener: Listener | None,
        lent: int,
        grammar: GrammarState | None = None,
    ) -> KVPages | None:
        """A prefill-only request whose first `lent` tokens' state a transfer brings: pages for
        its prompt (and drafts), those of the full entry pages of its prefix this cache holds
        shared (`reused_tokens`: the transfer leaves them alone); None when the pools are full.
        `start` starts it once the state is there; an abort frees it."""
        req = self.new_request(
            request_id,
            prompt_token_ids,
            params,
            prefill_only=True,
            listener=listener,
            grammar=grammar,
        )
        cache = self.cache
        plan = cache.begin_step() if cache else None
        hit = cache.lookup_pages(req, limit=lent) if cache else None
        need = req.num_tokens + self.scheduler.draft_tokens
        shared = self.scheduler.reserve(req, hit, need)
        copy_now(self.handoff.runner, plan)  # (evictions to and loads from the host tier)
        if shared is None:
            return None
        return KVPages(req.kv_pages(), lent, reused_tokens=shared)

    def start(self, request_id: str, lent: int) -> bool:
        """An adopted request's lent state has arrived: it computes the rest of its prompt
        from the next step on, the lent tokens counted as resumed from the cache. False if it
        was aborted meanwhile."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        req.num_cached_tokens = lent
        if self.cache is not None:
            self.cache.stats.queries += len(req.prompt_token_ids)
            self.cache.stats.hits += lent
        self.handoff.join(request_id, lent)
        return True
