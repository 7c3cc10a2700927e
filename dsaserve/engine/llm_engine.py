"""LLMEngine: one model, its KV pools, a scheduler and a runner, driven one step at a time.

Not thread-safe: one thread owns an engine (services drive it through `EngineLoop`). The engine
is the glue; each concern of a step lives in its own module:
- engine.scheduler picks each step's rows (continuous batching, chunked prefill, preemption,
  the prefix cache's hits);
- engine.outputs launches a step's sampling, waits for its ids and hands them out (async
  scheduling: the next step is launched before the last one's ids are waited for);
- engine.speculative.speculator runs a speculative step instead (verify, then draft);
- engine.handoff holds the two halves of disaggregated serving (a prefill-only request's KV
  held for a reader; a transferred request's pages reserved, then joined).

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

import torch

from dsaserve.engine import models
from dsaserve.engine.config import EngineConfig
from dsaserve.engine.handoff import Handoff
from dsaserve.engine.kv.layout import check_kv_cache_dtype
from dsaserve.engine.load import Load
from dsaserve.engine.loans import Loans
from dsaserve.engine.logits_processors import bad_words_ids
from dsaserve.engine.model_dir import model_identity
from dsaserve.engine.outputs import StepOutputs, request_output
from dsaserve.engine.parallel.group import SINGLE
from dsaserve.engine.parallel.launch import Followers
from dsaserve.engine.parallel.lockstep import Lockstep
from dsaserve.engine.prefix_cache.block_hash import cache_salt
from dsaserve.engine.prefix_cache.cache import PrefixCache
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.rank import build_runner, device_of, follower_main, keeps_quantized, world_of
from dsaserve.engine.request import Listener, Request, RequestError, RequestOutput, Status
from dsaserve.engine.request_checks import check_fits, check_token_ids
from dsaserve.engine.sampling_params import ContextLengthError, SamplingParams, resolve_max_tokens
from dsaserve.engine.scheduler import Scheduler
from dsaserve.engine.speculative.config import MTP
from dsaserve.engine.speculative.draft_head import draft_config
from dsaserve.engine.speculative.speculator import Speculator
from dsaserve.engine.step import RowSpan
from dsaserve.engine.structured import Constraints, GrammarState
from dsaserve.engine.text.grammar import GrammarError
from dsaserve.engine.text.text_stream import TextStream
from dsaserve.engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
        spec = config.speculative
        if spec is not None:  # (a ConfigError before any process starts; gamma resolved)
            _, spec = draft_config(cfg, spec, model_dir)
        self.speculative = spec
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
        drafts = spec.num_speculative_tokens if spec else 0
        past = drafts if spec is not None and spec.method == MTP else 0  # (Scheduler's)
        self.scheduler = Scheduler(
            self.pool, config.max_num_batched_tokens, self.prefix_cache, past
        )
        vocab = self.tokenizer.vocab_size
        self.constraints = Constraints(self.tokenizer, self.eos_token_ids)
        self.outputs = StepOutputs(
            self.scheduler, self.runner, self.constraints, vocab, self._finish
        )
        self.handoff = Handoff(
            self.scheduler, self.runner, self.prefix_cache, self.new_request, self._finish,
            drafts, vocab,
        )  # fmt: skip
        self.loans = Loans(self.handoff)
        noise = cfg.dspark.noise_token_id if getattr(cfg, "dspark", None) else None
        self.speculator = None if spec is None else Speculator(self.runner, spec, vocab, noise)
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
        prefill_only: bool = False,
        listener: Listener | None = None,
        grammar: GrammarState | None = None,
    ) -> Request:
        """Validate a request and build its state (not yet queued); `grammar`: its grammar's
        state when compiled already (a worker compiles off this thread), else compiled here."""
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        vocab = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        check_token_ids(prompt_token_ids, params, vocab)
        try:
            max_tokens = resolve_max_tokens(n, params.max_tokens, self.max_model_len)
        except ContextLengthError as e:
            raise RequestError(str(e)) from None
        check_fits(self.pool, n + max_tokens - 1 + 2 * self.scheduler.draft_tokens)  # (drafts)
        if params.grammar is not None and self.speculator is not None:
            # (drafts are neither proposed nor verified under a grammar's mask yet)
            raise RequestError("structured outputs are not served with --speculative-config yet")
        if params.grammar is not None and grammar is None:
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
            prefill_only=prefill_only,
            listener=listener,
            grammar=grammar,
            bad_words=bad_words_ids(self.tokenizer, params.bad_words),
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        listener: Listener | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """Queue a request (prefill_only: stop after its first token and hold its KV for a
        reader, engine.handoff; grammar: as new_request's)."""
        req = self.new_request(
            request_id,
            prompt_token_ids,
            params,
            prefill_only=prefill_only,
            listener=listener,
            grammar=grammar,
        )
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its KV; False if unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def _finish(self, req: Request, reason: str) -> None:
        """End a request wherever it is; frees its pages, slab row and staging blocks. What one
        that ran to its end computed stays in the prefix cache (`PrefixCache.keep`), copied on
        the engine's stream before anything can write its pages again."""
        cache = self.prefix_cache
        if cache is not None and reason != "abort" and req.status is Status.RUNNING:
            plan = cache.keep(req)
            if plan:
                self.runner.call("copy_pages", plan)
        self.scheduler.finish(req, reason)
        self.handoff.drop_staged(req.request_id)

    def has_unfinished(self) -> bool:
        sched = self.scheduler
        return bool(sched.waiting or sched.running or self.outputs.in_flight)

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
                req.listener(request_output(req, [], "", "abort", finished=True))

    # ---------------------------------------------------------------- stepping

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one forward step; returns the outputs that are ready (also
        handed to each request's listener): this step's, or with async scheduling the previous
        step's, whose ids are waited for once this one is queued."""
        with profiled("schedule"):
            if self.speculator is not None:
                self.speculator.plan(self.scheduler.running)
            batch = self.scheduler.schedule()
        if self._agree(bool(batch)) and not batch:
            self.runner.call("pad_step")  # another data-parallel engine computes
        if self.speculator is not None:
            return self.speculator.step(batch, self.outputs) if batch else []
        if not batch:
            return self.outputs.drain()
        if self.async_scheduling:
            return self.outputs.launch_ahead(batch)
        return self.outputs.launch_and_wait(batch)

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

    # ---------------------------------------------------------------- scoring

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one causal forward over token_ids (no sampling); vocab:
        the model's embedding rows, a padded embedding's included (LLM.score drops those)."""
        if self.scheduler.waiting or self.scheduler.running:
            raise RuntimeError("score() needs an idle engine")
        if self.outputs.in_flight is not None:  # (only rows of finished requests can be left)
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
                span = RowSpan(
                    start=start,
                    num_rows=len(part),
                    slab=req.slab_row,
                    token_ids=part,
                    lookback=req.lookback(start, self.pool.cfg.token_lookback),
                )
                self._agree(True)
                chunks.append(self.runner.forward_all_rows([span], num_decode=0))
            return torch.cat(chunks)
        finally:
            self.scheduler.free_kv(req)
