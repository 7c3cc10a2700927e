"""The two halves of disaggregated serving on one engine.

- Prefill only: a request added with `prefill_only=True` stops after its first token and keeps
  its KV (status HELD) for a reader on a decode worker until `release`. `stage` packs it into the
  pool's staging blocks (engine.kv.staging), which a reader pulls in a few large READs, and frees
  its pages; `held_pages` says where it is. How long a reader may take is the prefill worker's
  lease table's business (services.worker.leases), which releases what it gives up.
- Decode of a transferred request: `reserve` builds it with its first token (sampled on the
  prefill worker) and allocates its pages, a transfer fills them, `join` starts decoding it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dsaserve.engine.kv.layout import STAGING
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.prefix_cache.cache import PrefixCache
from dsaserve.engine.prefix_cache.checkpoint import CopyPlan
from dsaserve.engine.request import KVPages, Listener, Request, RequestError, Status
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.scheduler import Scheduler
from dsaserve.engine.structured import GrammarState


class NewRequest(Protocol):
    """Validates a request and builds its state (the engine's `new_request`)."""

    def __call__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        listener: Listener | None = None,
        grammar: GrammarState | None = None,
    ) -> Request: ...


def copy_now(runner: ModelRunner, plan: CopyPlan | None) -> None:
    """Run the prefix cache's copies outside a step, and wait for the device: a transfer that
    reads or writes these pages next does not wait for the engine's stream (nor for the steps
    before, which may still write pages freed meanwhile)."""
    if plan:
        runner.call("copy_pages", plan)
    if runner.device.type == "cuda":
        torch.cuda.current_stream(runner.device).synchronize()


class Handoff:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        prefix_cache: PrefixCache | None,
        new_request: NewRequest,
        finish: Callable[[Request, str], None],
        max_drafts: int,
        vocab_size: int,
    ) -> None:
        """finish: ends a request wherever it is (the engine's); max_drafts: the drafts a
        transferred request may carry (speculative decoding's K or gamma, else 0)."""
        self.scheduler, self.runner, self.prefix_cache = scheduler, runner, prefix_cache
        self.pool: KVPool = runner.pool
        self.new_request, self.finish = new_request, finish
        self.max_drafts, self.vocab_size = max_drafts, vocab_size
        self.staged: dict[str, list[int]] = {}  # held request -> its staging blocks

    # ---------------------------------------------------------------- prefill half

    def held_pages(self, request_id: str) -> KVPages:
        """Where a request held after its prefill keeps its KV: its pages, or after `stage`
        its staging blocks under "staging" (KeyError if it is not held)."""
        req = self.scheduler.requests[request_id]
        if req.status is not Status.HELD:
            raise KeyError(request_id)
        staged = self.staged.get(request_id)
        pages = {STAGING: staged} if staged else req.kv_pages()
        return KVPages(
            pages, req.num_computed, tuple(req.draft_token_ids), tuple(req.draft_confidences)
        )

    def stage(self, request_id: str) -> KVPages:
        """Pack a held request's KV into staging blocks and free its pages and slab row; when
        too few blocks are free, it stays in its pages. Returns `held_pages` (KeyError if the
        request is not held)."""
        held = self.held_pages(request_id)
        if STAGING not in held.pages:
            blocks = self.pool.stage(held.pages)
            if blocks is not None:
                self.staged[request_id] = blocks
                self.scheduler.free_kv(self.scheduler.requests[request_id])
        return self.held_pages(request_id)

    def release(self, request_id: str) -> bool:
        """Free the KV a prefill-only request holds (its reader is done, gave up, or its lease
        ran out). True if it was still held, i.e. nothing else could have written it."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is not Status.HELD:
            return False
        self.finish(req, req.finish_reason or "stop")
        return True

    def drop_staged(self, request_id: str) -> None:
        """A request ended: its staging blocks, if any, are free again."""
        blocks = self.staged.pop(request_id, None)
        if blocks is not None:
            self.pool.staging.free(blocks)

    # ---------------------------------------------------------------- decode half

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        listener: Listener | None = None,
        draft_token_ids: Sequence[int] = (),
        draft_confidences: Sequence[float] = (),
        grammar: GrammarState | None = None,
    ) -> KVPages | None:
        """Allocate pages for a prefilled request (prompt KV computed elsewhere, first token
        already sampled and sent, with the drafts after it when speculating, and DSpark's
        confidences in them: its first step verifies them); None when the pools are full right
        now. `grammar`: its grammar's state, compiled already (as the engine's new_request takes
        it)."""
        most, vocab = self.max_drafts, self.vocab_size
        if len(draft_token_ids) > most or any(not 0 <= t < vocab for t in draft_token_ids):
            raise RequestError(
                f"a prefilled request carries at most {most} draft token ids in [0, {vocab}); "
                f"got {list(draft_token_ids)[:8]}"
            )
        if draft_confidences and (
            len(draft_confidences) != len(draft_token_ids)
            or not all(0.0 <= c <= 1.0 for c in draft_confidences)
        ):
            raise RequestError(
                "draft confidences must be one probability in [0, 1] per draft token id; got "
                f"{list(draft_confidences)[:8]} for {len(draft_token_ids)} drafts"
            )
        req = self.new_request(
            request_id, prompt_token_ids, params, listener=listener, grammar=grammar
        )
        # Replay the first token so stop strings and text offsets continue where prefill left off.
        reason = req.append_token(first_token_id)
        req.text.take(finished=reason is not None)
        if reason is not None:
            raise RequestError(
                f"request {request_id!r} already finished at its first token ({reason})"
            )
        req.draft_token_ids = list(draft_token_ids)
        req.draft_confidences = list(draft_confidences)
        cache = self.prefix_cache
        plan = cache.begin_step() if cache else None
        # (a conversation's earlier turns decoded here left their pages: the transfer skips them)
        reused = self.scheduler.reserve(req, cache.lookup_pages(req) if cache else None)
        copy_now(self.runner, plan)  # (evictions to and loads from the host tier)
        if reused is None:
            return None
        return KVPages(req.kv_pages(), len(prompt_token_ids), reused_tokens=reused)

    def join(self, request_id: str, computed: int | None = None) -> None:
        """The reserved request's KV has arrived (in rank 0's pools), that of its first
        `computed` tokens (default: its prompt): from the next step on it decodes (or computes
        the rest of its prompt: engine.loans), with a copy on every rank."""
        req = self.scheduler.requests[request_id]
        self.runner.call("share_pages", req.kv_pages())
        req.num_computed = len(req.prompt_token_ids) if computed is None else computed
        self.scheduler.join(req)
