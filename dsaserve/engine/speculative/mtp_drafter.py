"""The MTP layer's drafts (speculative decoding with `"method": "mtp"`).

draft pass 1  after verification, before the hand-out: the MTP layer over the SAME rows as
              the target step (every row's token: the one after it, i.e. the next prompt
              token, or the token the target emitted at that row), fed the target's
              last-layer streams: its KV state follows the target's position for position,
              prompts included (a prefill worker's requests arrive at the decode worker
              with it), and the logits of each request's last emitted row are its first
              draft
passes 2..K   after the hand-out: one row per drafting request at the next position, its
              token the draft before, fed the MTP layer's own streams (the one MTP layer
              applied K times); a request's pages cover the K positions past its drafts
              that these passes write
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dsaserve.engine.request import Request, Status
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.speculative.adaptive import DraftLength
from dsaserve.engine.step import RowSpan, sampled_ref


class MTPDrafter:
    def __init__(self, runner: ModelRunner, length: DraftLength, vocab_size: int) -> None:
        self.runner, self.length, self.vocab_size = runner, length, vocab_size
        runner.call("keep_draft_streams")
        self._firsts: list[tuple[Request, int, int]] = []  # (sampler, its draft row, position)
        self._logits: torch.Tensor | None = None

    def before_hand_out(
        self, samplers: list[Request], counts: list[int], emitted: list[list[int]], k: int
    ) -> None:
        """Pass 1 while every page is still its request's (the MTP layer's KV state at every
        row; the first draft of each sampler, kept for `propose`). k = 0 (adaptive) skips it,
        unless a prefill-only request's state must go to its decode worker."""
        last = self.runner.last_step
        self._firsts, self._logits = [], None
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
