"""One speculative step around the target model's forward: verify the drafts each request sent
into it, hand out what is accepted, then draft the next ones with the checkpoint's draft head
(engine.speculative.mtp_drafter or dspark_drafter: which, `--speculative-config`'s method).

    target step   rows: a decoding request's newest token + its m drafts (m + 1 rows, causal
                  within the request, as a prefill chunk's), other requests' rows as always
    verify        engine.speculative.verify: each request emits its accepted drafts + 1 token
    draft         the drafter's work before the hand-out (MTP: its pass over the same rows),
                  the hand-out (stops, stop strings, max_tokens see only emitted tokens), the
                  drafter's proposals for the requests still decoding

Rows past the accepted ones wrote KV state at positions the next step computes again (the rings
keep KVCacheConfig.speculative_tokens rows spare so that nothing a later step reads is lost).
The engine waits for each step (verification decides the next step's positions), so a step's
results reach the host once: the emitted tokens, then the drafts. Before the next step is
scheduled, `plan` cuts each request's drafts to what is worth verifying (adaptive DSpark).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dsaserve.engine.logits_processors import RowTokens, adjust, changes_logits
from dsaserve.engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from dsaserve.engine.outputs import StepOutputs
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.request import Request, RequestOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampler import sample
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.speculative.adaptive import DraftLength
from dsaserve.engine.speculative.config import DSPARK, SpeculativeConfig
from dsaserve.engine.speculative.dspark_drafter import DSparkDrafter
from dsaserve.engine.speculative.mtp_drafter import MTPDrafter
from dsaserve.engine.speculative.stats import SpecDecodeStats
from dsaserve.engine.speculative.verify import accepted_tokens, verify_rows


@dataclasses.dataclass
class Verified:
    """What one step emits: per sampler, its tokens and (when asked) their logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


class Speculator:
    def __init__(
        self,
        runner: ModelRunner,
        spec: SpeculativeConfig,
        vocab_size: int,
        noise_token_id: int | None = None,
    ) -> None:
        """spec: resolved (engine.speculative.draft_head); vocab_size: the tokenizer's (rows of
        a padded head past it are never drafted); noise_token_id: DSpark's block filler."""
        self.runner, self.spec, self.vocab_size = runner, spec, vocab_size
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.length = DraftLength(spec)
        self.drafter: MTPDrafter | DSparkDrafter
        if spec.method == DSPARK:
            assert noise_token_id is not None
            self.drafter = DSparkDrafter(runner, self.length, vocab_size, noise_token_id)
        else:
            self.drafter = MTPDrafter(runner, self.length, vocab_size)

    def plan(self, running: list[Request]) -> None:
        """Before scheduling a step: each request's drafts cut to those worth verifying (DSpark
        with `adaptive`: by its confidences and the step's cost; otherwise all of them)."""
        if self.spec.method != DSPARK or not self.spec.adaptive:
            return
        drafting = [r for r in running if r.draft_token_ids]
        lengths = self.length.verify_lengths(
            [r.draft_confidences or [] for r in drafting], len(running), self.stats
        )
        for req, n in zip(drafting, lengths, strict=True):
            del req.draft_token_ids[n:]

    def step(self, batch: ScheduledBatch, outputs: StepOutputs) -> list[RequestOutput]:
        """One speculative step: verify the drafts the batch carries, hand out what is
        accepted, draft again. Waits for the device."""
        t0 = time.perf_counter()
        samplers, counts, logits, prompt_rows = self.runner.execute(batch)
        with profiled("verify"):
            outputs.mask_padded_vocab(logits)
            if prompt_rows:
                outputs.score_prompts(prompt_rows, logits[sum(counts) :])
            verified = self.verify(samplers, counts, logits[: sum(counts)])  # (on the host)
        rows = sum(s.num_rows for s in self.runner.last_step.spans)
        self.length.time_target(rows, time.perf_counter() - t0)
        k = self.choose(len(outputs.scheduler.running))
        with profiled("draft"):
            self.drafter.before_hand_out(samplers, counts, verified.tokens, k)
        emitted = []
        with profiled("outputs"):
            for req, tokens, logprobs in zip(
                samplers, verified.tokens, verified.logprobs, strict=True
            ):
                outputs.hold(req)  # (a prefill-only request's KV stays for its reader)
                out = outputs.emit(req, tokens, logprobs)
                if out is not None:
                    emitted.append(out)
        with profiled("draft"):
            self.drafter.propose(k)
        return emitted

    def verify(self, samplers: list[Request], counts: list[int], logits: torch.Tensor) -> Verified:
        """logits [sum(counts), V] of the samplers' rows (counts[i] = 1 + its drafts) -> what
        each emits; takes the rejected rows back from their `num_computed`."""
        params: list[SamplingParams] = []
        draws: list[int] = []
        drafts: list[int] = []
        plain: list[int] = []  # rows of samplers without drafts
        verified: list[int] = []  # rows of samplers that verify drafts
        reads: list[RowTokens | None] = []  # what each row's logits processors read
        for req, n in zip(samplers, counts, strict=True):
            adjusted = changes_logits(req.params)
            for j in range(n):
                params.append(req.params)
                draws.append(len(req.output_token_ids) + j)
                drafts.append(req.draft_token_ids[j] if j < n - 1 else -1)
                (verified if n > 1 else plain).append(len(params) - 1)
                reads.append(req.sampling_row(req.draft_token_ids[:j]) if adjusted else None)
        raw, logits = logits, adjust(logits, reads)  # (logprobs stay the raw distribution's)
        dev = logits.device
        tokens = torch.empty(len(params), dtype=torch.int64, device=dev)
        accepted = torch.zeros(len(params), dtype=torch.bool, device=dev)
        if plain:  # no drafts: the sampler as without speculation (seeded tokens alike)
            rows = torch.tensor(plain, device=dev)
            tokens[rows] = sample(
                logits[rows], [params[r] for r in plain], [draws[r] for r in plain]
            )
        if verified:
            rows = torch.tensor(verified, device=dev)
            acc, tok = verify_rows(
                logits[rows],
                [drafts[r] for r in verified],
                [params[r] for r in verified],
                [draws[r] for r in verified],
            )
            accepted[rows], tokens[rows] = acc, tok
        asks = [p.logprobs for p in params]
        table = logprob_table(raw, tokens, asks)
        host_tokens, host_accepted = tokens.tolist(), accepted.tolist()
        row_logprobs = read_logprobs(table, asks)
        out = Verified([], [])
        row = 0
        for req, n in zip(samplers, counts, strict=True):
            emitted = accepted_tokens(
                req.draft_token_ids[: n - 1],
                host_accepted[row : row + n - 1],
                host_tokens[row : row + n],
            )
            out.tokens.append(emitted)
            out.logprobs.append(row_logprobs[row : row + len(emitted)])
            self.stats.record(n - 1, len(emitted) - 1)
            req.num_computed -= n - len(emitted)  # rows of rejected drafts: computed again
            req.draft_token_ids, req.draft_confidences = [], []
            row += n
        return out

    def choose(self, batch: int) -> int:
        """Drafts per request for the next step of `batch` running requests (DSpark: always its
        whole block, one pass whatever its length; `plan` cuts per request)."""
        if self.spec.method == DSPARK:
            return self.spec.num_speculative_tokens
        return self.length.choose(batch, self.stats)
