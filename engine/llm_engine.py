"""LLMEngine: one model, its KV pools, a scheduler and a runner, driven one step at a time.

Not thread-safe: one thread owns an engine (services drive it through `EngineLoop`).
Besides plain requests it supports the two halves of disaggregated serving:
- prefill only: `add_request(..., hold_for_s=lease)` stops after the first token and holds
  the KV (`held_pages`) until `release` or until the lease runs out (`expire_leases`); `stage`
  moves held KV from its pages into the pool's staging blocks, which a reader pulls faster;
- decode of a transferred request: `reserve` allocates pages for it, a transfer fills
  them, `join` starts decoding.

Async scheduling (on by default, as in SGLang; vLLM's --async-scheduling): `step` schedules and
launches step N+1 before it waits for step N's sampled ids, so the host's work (scheduling,
inputs, detokenizing, stop checks, streaming) runs while the device computes. Step N+1's
decode rows read step N's ids on the device (engine.step.sampled_ref). The price is one row: a
request that stops at token t (EOS, a stop string) has already been scheduled for t + 1, whose
id is dropped. Pages freed while a step runs may still be written by it, which matters only to
writers outside the device's stream order: `reserve` (a transfer fills the pages) waits for the
device first.

With tensor_parallel_size N the engine is rank 0 of a group of N processes (engine.parallel):
it alone schedules, samples and owns the requests; its runner sends every step to the other
ranks, and `join` hands them the transferred KV, which reached rank 0's pools only. `close`
stops the other ranks.

With data_parallel_size D the engine is one of D (`data_parallel_rank`), each in a process of
its own with its own requests, scheduler and pools; with expert parallelism they share the
routed experts, so every step starts with the engines agreeing whether any of them computes
(engine.parallel.lockstep), one without work running a padded empty step. Such an engine must
be stepped even while it has no request (`steps_when_idle`), and `close` stops every engine of
the group (a data-parallel group is one failure domain, as a tensor-parallel one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from engine import models
from engine.async_copy import ToHost, to_device
from engine.checkpoint import model_identity
from engine.config import EngineConfig
from engine.kv.block_hash import cache_salt
from engine.kv.layout import STAGING, check_kv_cache_dtype
from engine.kv.prefix_cache import PrefixCache
from engine.load import Load
from engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from engine.parallel.group import SINGLE
from engine.parallel.launch import Followers
from engine.parallel.lockstep import Lockstep
from engine.profiling import profiled
from engine.rank import build_runner, device_of, follower_main, keeps_quantized, world_of
from engine.request import KVPages, Listener, Request, RequestError, RequestOutput, Status
from engine.runner import PromptRows
from engine.sampler import sample
from engine.sampling_params import ContextLengthError, SamplingParams, resolve_max_tokens
from engine.scheduler import ScheduledBatch, Scheduler
from engine.speculative.draft_head import draft_config
from engine.speculative.speculator import Speculator
from engine.step import RowSpan
from engine.structured import Bitmask, Constraints
from engine.text.grammar import GrammarError
from engine.text.text_stream import TextStream
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device: the requests it samples for, in row order, and their ids
    and logprob table on their way to the host."""

    samplers: list[Request]
    results: ToHost  # (ids [S] int64, logprob table or None)


class GroupStopped(RuntimeError):
    """Another engine of the data-parallel group closed it: this one cannot step any more."""


class LLMEngine:
    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig = EngineConfig()) -> None:
        self.config, self.model_dir = config, str(model_dir)
        world = world_of(config)
        self.device = device_of(config, world.leader)
        self.bind_thread()
        self.model_config = cfg = models.family(model_dir).ModelConfig.from_dir(model_dir)
        # before any process starts: a clear error for a model that does not split, or whose
        # KV rows the FP8 cache cannot hold
        cfg.check_tensor_parallel(config.tensor_parallel_size, keeps_quantized(config, cfg))
        if config.enable_expert_parallel and cfg.num_experts % world.size:
            raise ValueError(
                f"the model's {cfg.num_experts} routed experts do not split over the "
                f"{world.size} ranks of expert parallelism (data-parallel "
                f"{config.data_parallel_size} x tensor-parallel {config.tensor_parallel_size})"
            )
        check_kv_cache_dtype(cfg, config.kv_cache_dtype, config.page_size)
        self.speculative = config.speculative
        if self.speculative is not None:  # (a ConfigError before any process starts)
            draft_config(cfg, self.speculative)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | self.tokenizer.eos_token_ids
        self.followers = None
        self.lockstep: Lockstep | None = None  # data parallel with shared experts
        if world.size > 1:
            self.followers = Followers(world, self.device, follower_main, self.model_dir, config)
            if self.followers.lockstep is not None and config.enable_expert_parallel:
                self.lockstep = Lockstep(self.followers.lockstep)
        try:
            self.runner = build_runner(
                model_dir,
                config,
                self.followers.tp if self.followers else SINGLE,
                self.followers.channel if self.followers else None,
            )
        except BaseException:
            self.close()
            raise
        self.model, self.pool = self.runner.model, self.runner.pool
        # (what the budget holds: build_runner may have lowered it)
        self.config = config = dataclasses.replace(
            config, max_num_seqs=self.pool.kv_cfg.max_num_seqs
        )
        self.max_model_len = self.runner.max_context
        self.prefix_cache = None
        if config.enable_prefix_caching:
            layout = self.pool.layout_hash()
            salt = cache_salt(model_identity(model_dir), layout, config.kv_cache_dtype)
            self.prefix_cache = PrefixCache(
                self.pool, config.prefix_cache_checkpoint_interval, salt, self.runner.host
            )
        spec = self.speculative
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_batched_tokens,
            self.prefix_cache,
            spec.num_speculative_tokens if spec else 0,
        )
        self.speculator = None
        if spec is not None:
            self.speculator = Speculator(self.runner, spec, self.tokenizer.vocab_size)
        self._staged: dict[str, list[int]] = {}  # held request -> its staging blocks
        self._in_flight: LaunchedStep | None = None  # async scheduling: the step the device runs
        # outputs of the step in flight, completed early for a grammar's sake (`_bitmask`)
        self._completed_early: list[RequestOutput] = []
        self.constraints = Constraints(self.tokenizer, self.eos_token_ids)
        # may change between steps (a bench); speculative steps wait for each step: the
        # accepted drafts decide where the next one starts
        self.async_scheduling = config.async_scheduling and spec is None
        log.info(
            "KV pool: %d pages (%s), one request up to %d tokens, layout %s",
            self.pool.num_total_pages,
            ", ".join(f"{g}={p.num_pages - 1}" for g, p in self.pool.groups.items()),
            self.pool.token_capacity(),
            self.pool.layout_description(),
        )

    def bind_thread(self) -> None:
        """Make the engine's GPU the calling thread's current device (each thread has its own):
        Triton launches and CUDA events go to the current device, whatever their tensors'.
        A plain "cuda" already means the current device (and set_device refuses it)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def group_alive(self) -> bool:
        """Whether every rank of the engine's tensor-parallel group still runs."""
        return self.followers is None or self.followers.alive()

    @property
    def steps_when_idle(self) -> bool:
        """Whether `step` must run while this engine has no request (another engine of its
        data-parallel group may compute, and needs this one's ranks in its MoE layers)."""
        return self.lockstep is not None

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do on one rank), and
        tell the other engines of a data-parallel group to stop."""
        if self.lockstep is not None:
            with contextlib.suppress(RuntimeError):  # (a peer that died already closed it)
                self.lockstep.agree(False, stop=True)
            self.lockstep = None
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    # ---------------------------------------------------------------- requests

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_for_s: float | None = None,
        listener: Listener | None = None,
    ) -> Request:
        """Validate a request and build its state (not yet queued)."""
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        # Rows of a padded embedding past the tokenizer are no tokens: refuse them too.
        vocab = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        if n == 0:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        try:
            max_tokens = resolve_max_tokens(n, params.max_tokens, self.max_model_len)
        except ContextLengthError as e:
            raise RequestError(str(e)) from None
        needed_tokens = n + max_tokens - 1 + 2 * self.scheduler.draft_tokens  # (drafts' rows)
        for g, group in self.pool.groups.items():
            need, have = self.pool.pages_for(g, needed_tokens), group.num_pages - 1
            if need > have:
                raise RequestError(
                    f"{needed_tokens} tokens need {need} pages of the {g!r} KV pool, which has "
                    f"{have}; lower max_tokens or give the worker more KV memory "
                    "(--kv-cache-memory-bytes)"
                )
        grammar = None
        if params.grammar is not None and self.speculator is not None:
            # (drafts are neither proposed nor verified under a grammar's mask yet)
            raise RequestError("structured outputs are not served with --speculative-config yet")
        if params.grammar is not None:
            try:
                grammar = self.constraints.state(params.grammar)
            except GrammarError as e:
                raise RequestError(f"the grammar does not compile: {e}") from None
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            text=TextStream(self.tokenizer, params.stop),
            eos_token_ids=self.eos_token_ids,
            hold_for_s=hold_for_s,
            listener=listener,
            grammar=grammar,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_for_s: float | None = None,
        listener: Listener | None = None,
    ) -> None:
        req = self.new_request(
            request_id, prompt_token_ids, params, hold_for_s=hold_for_s, listener=listener
        )
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its KV; False if unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def load(self) -> Load:
        sched = self.scheduler
        return Load(
            running=len(sched.running),
            waiting=len(sched.waiting),
            held=sched.num_held,
            free_pages=self.pool.num_free_pages,
            total_pages=self.pool.num_total_pages,
            cached_pages=self.prefix_cache.num_cached_pages if self.prefix_cache else 0,
        )

    def fail_all(self) -> None:
        """The engine cannot step any more: end every request's stream with an abort."""
        for req in list(self.scheduler.requests.values()):
            if req.listener is not None:
                req.listener(self._output(req, [], "", "abort", finished=True))

    # ---------------------------------------------------------------- disaggregation

    def held_pages(self, request_id: str) -> KVPages:
        """Where a request held after its prefill keeps its KV: its pages, or after `stage`
        its staging blocks under "staging" (KeyError if it is not held)."""
        req = self.scheduler.requests[request_id]
        if req.status is not Status.HELD:
            raise KeyError(request_id)
        staged = self._staged.get(request_id)
        pages = {STAGING: staged} if staged else req.kv_pages()
        return KVPages(pages, req.num_computed, tuple(req.draft_token_ids))

    def stage(self, request_id: str) -> KVPages:
        """Pack a held request's KV into staging blocks and free its pages and slab row; when
        too few blocks are free, it stays in its pages. Returns `held_pages` (KeyError if the
        request is not held)."""
        held = self.held_pages(request_id)
        if STAGING not in held.pages:
            blocks = self.pool.stage(held.pages)
            if blocks is not None:
                self._staged[request_id] = blocks
                self.scheduler.free_kv(self.scheduler.requests[request_id])
        return self.held_pages(request_id)

    def claim(self, request_id: str, hold_s: float, now: float) -> float | None:
        """A reader is about to read a held request's pages: keep them until at least
        `now + hold_s` (time.monotonic()). Returns the lease deadline, or None if the pages are
        no longer held (the lease ran out, or the request was aborted or released)."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is not Status.HELD:
            return None
        req.lease_deadline = max(req.lease_deadline or now, now + hold_s)
        return req.lease_deadline

    def release(self, request_id: str) -> bool:
        """Free the KV a prefill-only request holds (its reader is done, or gave up). True if
        the pages were still held, i.e. nothing else could have written them until now."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is not Status.HELD:
            return False
        self._finish(req, req.finish_reason or "stop")
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Free every held request whose lease ended before `now` (time.monotonic()); their ids."""
        expired = [
            r
            for r in self.scheduler.requests.values()
            if r.status is Status.HELD and r.lease_deadline is not None and r.lease_deadline < now
        ]
        for req in expired:
            self._finish(req, req.finish_reason or "stop")
        return [r.request_id for r in expired]

    def _finish(self, req: Request, reason: str) -> None:
        """End a request wherever it is; frees its pages, slab row and staging blocks."""
        self.scheduler.finish(req, reason)
        blocks = self._staged.pop(req.request_id, None)
        if blocks is not None:
            self.pool.staging.free(blocks)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        listener: Listener | None = None,
        draft_token_ids: Sequence[int] = (),
    ) -> KVPages | None:
        """Allocate pages for a prefilled request (prompt KV computed elsewhere, first token
        already sampled and sent, with the drafts after it when speculating: its first step
        verifies them); None when the pools are full right now."""
        most = self.speculator.spec.num_speculative_tokens if self.speculator else 0
        vocab = self.tokenizer.vocab_size
        if len(draft_token_ids) > most or any(not 0 <= t < vocab for t in draft_token_ids):
            raise RequestError(
                f"a prefilled request carries at most {most} draft token ids in [0, {vocab}); "
                f"got {list(draft_token_ids)[:8]}"
            )
        req = self.new_request(request_id, prompt_token_ids, params, listener=listener)
        # Pages freed while a step runs may still be written by it; the transfer that fills
        # the pages given here does not wait for the device's stream.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        # Replay the first token so stop strings and text offsets continue where prefill left off.
        reason = req.append_token(first_token_id)
        req.text.take(finished=reason is not None)
        if reason is not None:
            raise RequestError(
                f"request {request_id!r} already finished at its first token ({reason})"
            )
        req.draft_token_ids = list(draft_token_ids)
        plan = self.prefix_cache.begin_step() if self.prefix_cache else None
        reserved = self.scheduler.reserve(req)
        if plan:  # evictions to the host tier: read before the transfer writes the pages
            self.runner.call("copy_pages", plan)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        if not reserved:
            return None
        return KVPages(pages=req.kv_pages(), num_tokens=len(prompt_token_ids))

    def join(self, request_id: str) -> None:
        """The reserved request's KV has arrived (in rank 0's pools): decode it from the next
        step on, with a copy on every rank."""
        req = self.scheduler.requests[request_id]
        self.runner.call("share_pages", req.kv_pages())
        req.num_computed = len(req.prompt_token_ids)
        self.scheduler.join(req)

    # ---------------------------------------------------------------- stepping

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one forward step; returns the outputs that are ready (also
        handed to each request's listener): this step's, or with async scheduling the previous
        step's, whose ids are waited for once this one is queued."""
        with profiled("schedule"):
            batch = self.scheduler.schedule()
        if self._agree(bool(batch)) and not batch:
            self.runner.call("pad_step")  # another data-parallel engine computes
        if self.speculator is not None:
            return self._speculative_step(batch) if batch else []
        launched = self._launch(batch) if batch else None
        done = [s for s in (self._in_flight, launched) if s is not None]  # oldest first
        self._in_flight = done.pop() if self.async_scheduling and launched else None
        early, self._completed_early = self._completed_early, []
        return early + [out for s in done for out in self._complete(s)]

    def _speculative_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Verify the drafts the batch carries, hand out what is accepted, draft again
        (engine.speculative.speculator); waits for the device."""
        speculator = self.speculator
        assert speculator is not None
        t0 = time.perf_counter()
        samplers, counts, logits, prompt_rows = self.runner.execute(batch)
        with profiled("verify"):
            if self.tokenizer.vocab_size < logits.shape[1]:
                logits[:, self.tokenizer.vocab_size :] = float("-inf")
            if prompt_rows:
                self._score_prompts(prompt_rows, logits[sum(counts) :])
            verified = speculator.verify(samplers, counts, logits[: sum(counts)])  # (on the host)
        rows = sum(s.num_rows for s in self.runner.last_step.spans)
        speculator.length.time_target(rows, time.perf_counter() - t0)
        k = speculator.choose(len(self.scheduler.running))
        with profiled("draft"):
            speculator.draft_first(samplers, counts, verified.tokens, k)
        outputs = []
        with profiled("outputs"):
            for req, tokens, logprobs in zip(
                samplers, verified.tokens, verified.logprobs, strict=True
            ):
                if req.prefill_only:  # its one token: the KV stays for the decode worker
                    self.scheduler.hold(req)
                out = self._emit(req, tokens, logprobs)
                if out is not None:
                    outputs.append(out)
        with profiled("draft"):
            speculator.propose(k)
        return outputs

    def _agree(self, work: bool) -> bool:
        """Whether any engine of the data-parallel group runs a forward now (each calls this
        once before each forward; with one engine: `work`)."""
        if self.lockstep is None:
            return work
        agreed = self.lockstep.agree(work)
        if agreed.stop:
            self.lockstep = None  # (its closer has left the group)
            raise GroupStopped("another engine of the data-parallel group stopped")
        return agreed.work

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the batch's forward and sampling on the device; nothing here waits for it."""
        samplers, _, logits, prompt_rows = self.runner.execute(batch)
        if self.tokenizer.vocab_size < logits.shape[1]:
            # A padded embedding has rows no token maps to; never sample or score them.
            logits[:, self.tokenizer.vocab_size :] = float("-inf")
        if prompt_rows:
            self._score_prompts(prompt_rows, logits[len(samplers) :])
        if not samplers:
            return LaunchedStep([], ToHost())
        logits = logits[: len(samplers)]
        with profiled("sample"):
            mask = self._bitmask(samplers, logits.device)
            draws = [len(r.output_token_ids) + r.num_inflight for r in samplers]
            tokens = sample(logits, [r.params for r in samplers], draws, mask)  # [S] on the device
            table = logprob_table(logits, tokens, [r.params.logprobs for r in samplers])
        self.runner.sampled = tokens
        for row, req in enumerate(samplers):
            req.num_inflight += 1
            req.inflight_row = row
            if req.prefill_only:  # its one token: the KV stays for the decode worker
                self.scheduler.hold(req)
        return LaunchedStep(samplers, ToHost(tokens, table))

    def _bitmask(self, samplers: list[Request], device: torch.device) -> Bitmask | None:
        """The structured outputs' bitmask of a launched step's samplers (None if none is
        constrained). A constrained request whose newest token is still in flight needs it
        first: the step in flight is completed now, while the device runs this step's forward
        (its outputs go out with this step's `step`)."""
        constrained = [(row, r) for row, r in enumerate(samplers) if r.grammar is not None]
        if not constrained:
            return None
        if self._in_flight is not None and any(r.num_inflight for _, r in constrained):
            self._completed_early += self._complete(self._in_flight)
            self._in_flight = None
        rows = []
        for row, req in constrained:
            assert req.grammar is not None and req.num_inflight == 0
            req.grammar.advance(req.output_token_ids)
            rows.append((row, req.grammar))
        return self.constraints.bitmask(rows, device)

    @staticmethod
    def _score_prompts(spans: list[PromptRows], logits: torch.Tensor) -> None:
        """The prompt logprobs these rows' logits [P, vocab] give, onto their requests. Read on
        the host at once (a wait that only steps prefilling such a request pay)."""
        targets = [t for span in spans for t in span.targets()]
        counts: list[int | None] = [
            span.request.params.prompt_logprobs for span in spans for _ in range(span.count)
        ]
        table = logprob_table(logits, to_device(targets, torch.int64, logits.device), counts)
        entries = iter(read_logprobs(None if table is None else table.cpu(), counts))
        for span in spans:
            for _ in range(span.count):
                entry = next(entries)
                assert entry is not None  # (every row asked)
                span.request.prompt_logprobs.append(entry)

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's ids and hand each request its output."""
        if not step.samplers:
            return []
        with profiled("wait"):
            tokens, table = step.results.wait()
        assert tokens is not None  # (a step with samplers sampled)
        with profiled("outputs"):
            return self._hand_out(step.samplers, tokens.tolist(), table)

    def _hand_out(
        self, samplers: list[Request], tokens: list[int], table: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Each sampler's token (host ids, logprob table) to its request: stops, text, lease."""
        logprobs = read_logprobs(table, [r.params.logprobs for r in samplers])
        outputs = []
        for req, token, token_lp in zip(samplers, tokens, logprobs, strict=True):
            out = self._emit(req, [token], [token_lp], in_flight=True)
            if out is not None:
                outputs.append(out)
        return outputs

    def _emit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        in_flight: bool = False,
    ) -> RequestOutput | None:
        """A request's new tokens (in_flight: its oldest in-flight one), up to the one it
        stops at: stops, text, lease, its listener. None for a request already finished."""
        if req.status is Status.FINISHED:  # aborted, or stopped a token earlier
            return None
        reason, n = None, 0
        while reason is None and n < len(tokens):
            reason = req.append_token(tokens[n], in_flight=in_flight)
            n += 1
        tokens, logprobs = tokens[:n], logprobs[:n]
        finished = reason is not None
        if req.status is Status.HELD:  # prefill only: the reader's lease starts now
            assert req.hold_for_s is not None
            # (a claim made before the token was known may already reach further)
            req.lease_deadline = max(req.lease_deadline or 0.0, time.monotonic() + req.hold_for_s)
        if reason is not None:
            self._finish(req, reason)  # (a held request may already be staged)
        text = req.text.take(finished)
        out = self._output(
            req,
            tokens,
            text,
            reason,
            finished=finished or req.prefill_only,
            logprobs=None if logprobs[0] is None else cast(list[TokenLogprobs], logprobs),
        )
        if req.params.prompt_logprobs is not None and len(req.output_token_ids) == len(tokens):
            out.prompt_logprobs = list(req.prompt_logprobs)  # with the request's first tokens
        if req.listener is not None:
            req.listener(out)
        return out

    @staticmethod
    def _output(
        req: Request,
        tokens: list[int],
        text: str,
        reason: str | None,
        *,
        finished: bool,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            logprobs=logprobs,
            cached_tokens=req.num_cached_tokens or 0,
        )

    # ---------------------------------------------------------------- scoring

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one causal forward over token_ids (no sampling); vocab:
        the model's embedding rows, a padded embedding's included (LLM.score drops those)."""
        if self.scheduler.waiting or self.scheduler.running:
            raise RuntimeError("score() needs an idle engine")
        if self._in_flight is not None:  # (only rows of finished requests can be left in it)
            self.step()
        req = self.new_request("__score__", token_ids, SamplingParams(max_tokens=1))
        plan = self.prefix_cache.begin_step() if self.prefix_cache else None
        if not self.scheduler.try_allocate(req, len(token_ids)):
            raise RequestError(f"{len(token_ids)} tokens do not fit in the KV pools")
        if plan:  # (evictions to the host tier)
            self.runner.call("copy_pages", plan)
        try:
            chunks, step = [], self.config.max_num_batched_tokens
            for start in range(0, len(token_ids), step):
                part = token_ids[start : start + step]
                span = RowSpan(start=start, num_rows=len(part), slab=req.slab_row, token_ids=part)
                self._agree(True)
                chunks.append(self.runner.forward_all_rows([span], num_decode=0))
            return torch.cat(chunks)
        finally:
            self.scheduler.free_kv(req)
