"""One speculative step around the target model's forward: verify the drafts each request sent
into it, then draft the next ones with the MTP layer.

    target step   rows: a decoding request's newest token + its m drafts (m + 1 rows, causal
                  within the request, as a prefill chunk's), other requests' rows as always
    verify        engine.speculative.verify: each request emits its accepted drafts + 1 token
    draft pass 1  the MTP layer over the SAME rows (every row's token: the one after it, i.e.
                  the next prompt token, or the token the target emitted at that row), fed the
                  target's last-layer streams: its KV state follows the target's position for
                  position, prompts included (a prefill worker's requests arrive at the decode
                  worker with it), and the logits of each request's last emitted row are its
                  first draft
    passes 2..K   one row per drafting request at the next position, its token the draft
                  before, fed the MTP layer's own streams (the one MTP layer applied K times)

Rows past the accepted ones wrote KV state at positions the next step computes again (the rings
keep KVCacheConfig.speculative_tokens rows spare so that nothing a later step reads is lost).
The engine waits for each step (verification decides the next step's positions), so a step's
results reach the host once: the emitted tokens, then the drafts.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dsaserve.engine.logits_processors import RowTokens, adjust, changes_logits
from dsaserve.engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from dsaserve.engine.outputs import StepOutputs
from dsaserve.engine.profile.ranges import profiled
from dsaserve.engine.request import Request, RequestOutput, Status
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampler import sample
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.speculative.adaptive import DraftLength
from dsaserve.engine.speculative.config import SpeculativeConfig
from dsaserve.engine.speculative.stats import SpecDecodeStats
from dsaserve.engine.speculative.verify import accepted_tokens, verify_rows
from dsaserve.engine.step import RowSpan, sampled_ref


@dataclasses.dataclass
class Verified:
    """What one step emits: per sampler, its tokens and (when asked) their logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


class Speculator:
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig, vocab_size: int) -> None:
        """vocab_size: the tokenizer's (rows of a padded head past it are never drafted)."""
        self.runner, self.spec, self.vocab_size = runner, spec, vocab_size
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.length = DraftLength(spec)
        runner.call("keep_draft_streams")

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
            self.draft_first(samplers, counts, verified.tokens, k)
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
            self.propose(k)
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
            self.length.offer(n - 1)
            req.num_computed -= n - len(emitted)  # rows of rejected drafts: computed again
            req.draft_token_ids = []
            row += n
        return out

    def choose(self, batch: int) -> int:
        """Drafts per request for the next step of `batch` running requests."""
        return self.length.choose(batch, self.stats)

    def draft_first(
        self, samplers: list[Request], counts: list[int], emitted: list[list[int]], k: int
    ) -> None:
        """After `verify`, before any request is handed its tokens (every page is still its
        request's): the MTP layer's first pass over the step's rows (its KV state at every
        row; the first draft of each sampler, kept for `propose`). k = 0 (adaptive) skips it,
        unless a prefill-only request's state must go to its decode worker."""
        last = self.runner.last_step
        self._firsts: list[tuple[Request, int, int]] = []  # (sampler, its draft row, position)
        self._logits = None
        if k == 0 and not any(req.prefill_only for req in last.requests):
            return
        self._t0, self._rows = time.perf_counter(), sum(s.num_rows for s in last.spans)
        emits = {
            id(req): (n, tokens) for req, n, tokens in zip(samplers, counts, emitted, strict=True)
        }
        spans, rows, row = [], [], 0
        for req, span in zip(last.requests, last.spans, strict=True):
            n, tokens = emits.get(id(req), (0, []))
            spans.append(dataclasses.replace(span, token_ids=_following(req, span, tokens)))
            if tokens:  # the row whose input is its last emitted token's predecessor
                at = span.num_rows - n + len(tokens) - 1
                self._firsts.append((req, row + at, span.start + at))
                rows.append(row + at)
            row += span.num_rows
        self._logits = self.runner.call("draft", spans, last.num_decode, rows)

    def propose(self, k: int) -> None:
        """After the hand-out: up to k drafts for each sampler that still decodes, here or (a
        prefill-only request held for its reader) on a decode worker, which gets them with the
        KV (KVPages.draft_token_ids) and verifies them at its first step; the rest of the MTP
        layer's passes, stored in each request's `draft_token_ids`."""
        logits, firsts = self._logits, self._firsts
        if logits is None or k == 0:
            return
        want = [  # (index in firsts, request, drafts)
            (i, req, min(k, req.max_tokens - len(req.output_token_ids) - 1))
            for i, (req, _, _) in enumerate(firsts)
            if req.status is (Status.HELD if req.prefill_only else Status.RUNNING)
        ]
        want = [w for w in want if w[2] > 0]
        if not want:
            return
        vocab = self.vocab_size
        index = torch.tensor([i for i, _, _ in want], device=logits.device)
        drafts = [logits[index, :vocab].argmax(dim=-1)]  # [len(want)] the first drafts
        alive = list(range(len(want)))  # the `want` entries the last pass drafted for
        stream_rows = [firsts[i][1] for i, _, _ in want]  # their rows in that pass
        for step in range(1, max(n for _, _, n in want)):
            keep = [j for j, w in enumerate(alive) if want[w][2] > step]
            self.runner.sampled = drafts[-1]
            spans = [
                RowSpan(firsts[want[alive[j]][0]][2] + step, 1, want[alive[j]][1].slab_row,
                        [sampled_ref(j)])
                for j in keep
            ]  # fmt: skip
            out = self.runner.call("draft_next", spans, [stream_rows[j] for j in keep])
            assert out is not None
            drafts.append(out[:, :vocab].argmax(dim=-1))
            alive, stream_rows = [alive[j] for j in keep], list(range(len(keep)))
            self._rows += len(keep)
        host = [d.tolist() for d in drafts]
        self.length.time_draft(self._rows, time.perf_counter() - self._t0)
        alive = list(range(len(want)))
        for step, ids in enumerate(host):
            alive = [w for w in alive if want[w][2] > step]
            for w, token in zip(alive, ids, strict=True):
                want[w][1].draft_token_ids.append(token)


def _following(req: Request, span: RowSpan, emitted: list[int]) -> list[int]:
    """The token after each row of `span` (the draft head's input there): the request's own
    next tokens, then what it emitted this step; rows past those (rejected drafts) repeat the
    last one, their state being computed again next step."""
    start, n = span.start + 1, span.num_rows
    known = max(0, min(n, req.num_tokens - start))
    out = req.tokens(start, known) + emitted[: n - known]
    return out + [out[-1]] * (n - len(out))
