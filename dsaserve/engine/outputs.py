"""A step's way out: its sampling queued on the device, its ids waited for, each request handed
its tokens (stop checks, text, listener).

Async scheduling (on by default, as in SGLang; vLLM's --async-scheduling): `launch_ahead` queues
step N+1 before it waits for step N's sampled ids, so the host's work (scheduling, inputs,
detokenizing, stop checks, streaming) runs while the device computes. Step N+1's decode rows
read step N's ids on the device (engine.step.sampled_ref). What keeps it safe:
- tokens in flight: a request sampled by a launched step counts the token
  (`Request.num_inflight`) before its id is known; results reach pinned host memory behind one
  event (engine.async_copy);
- ends are learnt a step late: a request whose max_tokens-th token is in flight is not
  scheduled again (`Request.ends_in_flight`); one that stops at token t (EOS, a stop string) has
  already been scheduled for t + 1, whose id is dropped (the price: one row); a preempted
  request is re-admitted only once its in-flight token is known; a prefill-only request is held
  from the step that samples its token (`hold`: no later step touches its pages);
- freed pages: pages freed while a step runs may still be written by it; every later step is
  ordered after it on the stream, and the one writer outside that order, a KV transfer into
  pages engine.handoff's `reserve` hands out, waits for the device first.
A request whose sampling reads its own tokens (a grammar, a penalty) completes the step in flight
only after this step's forward is launched (`_settle`). Speculative steps wait for each step
instead (engine.speculative.speculator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from dsaserve.engine.async_copy import ToHost, to_device
from dsaserve.engine.logits_processors import adjust, changes_logits, reads_ids
from dsaserve.engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.request import Request, RequestOutput, Status
from dsaserve.engine.runner import ModelRunner, PromptRows
from dsaserve.engine.sampler import sample
from dsaserve.engine.scheduler import ScheduledBatch, Scheduler
from dsaserve.engine.structured import Bitmask, Constraints


@dataclass
class LaunchedStep:
    """A step queued on the device: the requests it samples for, in row order, and their ids
    and logprob table on their way to the host."""

    samplers: list[Request]
    results: ToHost  # (ids [S] int64, logprob table or None)


class StepOutputs:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        constraints: Constraints,
        vocab_size: int,
        finish: Callable[[Request, str], None],
    ) -> None:
        """vocab_size: the tokenizer's (a padded head's rows past it are never sampled);
        finish: ends a request wherever it is (the engine's, which also frees staged KV)."""
        self.scheduler, self.runner, self.constraints = scheduler, runner, constraints
        self.vocab_size, self.finish = vocab_size, finish
        self.in_flight: LaunchedStep | None = None  # async scheduling: the step the device runs
        # outputs of the step in flight, completed early for its tokens' sake (`_settle`)
        self.completed_early: list[RequestOutput] = []

    # ---------------------------------------------------------------- a step's three ways

    def launch_ahead(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Async scheduling: queue this step, then complete the one before it, whose ids reach
        the host while the device runs this one."""
        launched = self.launch(batch)
        previous, self.in_flight = self.in_flight, launched  # (after `launch`: see `_settle`)
        return self._completed(previous)

    def launch_and_wait(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Queue this step and wait for it (and for a step still in flight, oldest first)."""
        launched = self.launch(batch)
        previous, self.in_flight = self.in_flight, None
        return self._completed(previous, launched)

    def drain(self) -> list[RequestOutput]:
        """Nothing to launch: complete the step in flight, if any."""
        previous, self.in_flight = self.in_flight, None
        return self._completed(previous)

    def _completed(self, *steps: LaunchedStep | None) -> list[RequestOutput]:
        early, self.completed_early = self.completed_early, []
        return early + [out for s in steps if s is not None for out in self.complete(s)]

    # ---------------------------------------------------------------- pieces

    def mask_padded_vocab(self, logits: torch.Tensor) -> None:
        """A padded embedding has rows no token maps to; never sample or score them."""
        if self.vocab_size < logits.shape[1]:
            logits[:, self.vocab_size :] = float("-inf")

    def hold(self, req: Request) -> None:
        """A prefill-only request keeps its KV for its reader from the step that samples its
        one token on (no later step may touch it)."""
        if req.prefill_only:
            self.scheduler.hold(req)

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the batch's forward and sampling on the device; nothing here waits for it."""
        samplers, _, logits, prompt_rows = self.runner.execute(batch)
        self.mask_padded_vocab(logits)
        if prompt_rows:
            self.score_prompts(prompt_rows, logits[len(samplers) :])
        if not samplers:
            return LaunchedStep([], ToHost())
        logits = logits[: len(samplers)]
        with profiled("sample"):
            self._settle(samplers)
            mask = self._bitmask(samplers, logits.device)
            draws = [len(r.output_token_ids) + r.num_inflight for r in samplers]
            rows = [r.sampling_row() if changes_logits(r.params) else None for r in samplers]
            adjusted = adjust(logits, rows)  # (logprobs stay the raw ones)
            tokens = sample(adjusted, [r.params for r in samplers], draws, mask)  # [S] on device
            table = logprob_table(logits, tokens, [r.params.logprobs for r in samplers])
        self.runner.sampled = tokens
        for row, req in enumerate(samplers):
            req.num_inflight += 1
            req.inflight_row = row
            self.hold(req)
        return LaunchedStep(samplers, ToHost(tokens, table))

    def _settle(self, samplers: list[Request]) -> None:
        """A request whose sampling reads its own tokens (a grammar, a penalty, bad words)
        needs its newest one on the host: if it is still in flight, the step in flight is
        completed now, while the device runs this step's forward (its outputs go out with this
        step's). Rows that read none of their tokens never wait."""
        if self.in_flight is not None and any(
            r.num_inflight and (r.grammar is not None or reads_ids(r.params)) for r in samplers
        ):
            self.completed_early += self.complete(self.in_flight)
            self.in_flight = None

    def _bitmask(self, samplers: list[Request], device: torch.device) -> Bitmask | None:
        """The structured outputs' bitmask of a launched step's samplers (None if none is
        constrained; their tokens are on the host: `_settle`)."""
        constrained = [(row, r) for row, r in enumerate(samplers) if r.grammar is not None]
        if not constrained:
            return None
        rows = []
        for row, req in constrained:
            assert req.grammar is not None and req.num_inflight == 0
            req.grammar.advance(req.output_token_ids)
            rows.append((row, req.grammar))
        return self.constraints.bitmask(rows, device)

    @staticmethod
    def score_prompts(spans: list[PromptRows], logits: torch.Tensor) -> None:
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

    def complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's ids and hand each request its token (with its logprobs)."""
        if not step.samplers:
            return []
        with profiled("wait"):
            tokens, table = step.results.wait()
        assert tokens is not None  # (a step with samplers sampled)
        with profiled("outputs"):
            logprobs = read_logprobs(table, [r.params.logprobs for r in step.samplers])
            outputs = []
            for req, token, token_lp in zip(step.samplers, tokens.tolist(), logprobs, strict=True):
                out = self.emit(req, [token], [token_lp], in_flight=True)
                if out is not None:
                    outputs.append(out)
            return outputs

    def emit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        in_flight: bool = False,
    ) -> RequestOutput | None:
        """A request's new tokens (in_flight: its oldest in-flight one), up to the one it
        stops at: stops, text, its listener. None for a request already finished."""
        if req.status is Status.FINISHED:  # aborted, or stopped a token earlier
            return None
        reason, n = None, 0
        while reason is None and n < len(tokens):
            reason = req.append_token(tokens[n], in_flight=in_flight)
            n += 1
        tokens, logprobs = tokens[:n], logprobs[:n]
        finished = reason is not None
        if reason is not None:
            self.finish(req, reason)  # (a held request may already be staged)
        out = request_output(
            req,
            tokens,
            req.text.take(finished),
            reason,
            finished=finished or req.prefill_only,
            logprobs=None if logprobs[0] is None else cast(list[TokenLogprobs], logprobs),
        )
        if req.params.prompt_logprobs is not None and len(req.output_token_ids) == len(tokens):
            out.prompt_logprobs = list(req.prompt_logprobs)  # with the request's first tokens
        if req.listener is not None:
            req.listener(out)
        return out


def request_output(
    req: Request,
    tokens: list[int],
    text: str,
    reason: str | None,
    *,
    finished: bool,
    logprobs: list[TokenLogprobs] | None = None,
) -> RequestOutput:
    """What leaves the engine about `req` now: its new tokens and text, and its counts."""
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
        stop_reason=req.stop_reason,
    )
