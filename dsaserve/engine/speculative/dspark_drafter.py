"""The DSpark head's drafts (speculative decoding with `"method": "dspark"`).

The head's context needs no pass of its own: every target step writes it (the model taps the
target's hidden states; models.deepseek_v4.dspark). After the hand-out, each sampler that still
decodes (here, or a prefill-only request held for its decode worker) gets one draft block: its
newest token (the anchor, at position num_computed) and gamma - 1 noise tokens in one pass of
the draft layers, then the Markov head's serial pass: gamma drafts and, with a confidence head,
the chance each is accepted (Request.draft_confidences; engine.speculative.adaptive decides from
them how many the next step verifies). A step computes at most max_num_batched_tokens rows (the
pools' scratch rows), so a large batch drafts in several passes. The block writes no page (its
rows stay in scratch rows), so the scheduler reserves no positions for it past a request's
verified rows. tests/dspark_reference.py is a plain-torch head written from DeepSpec's
description, the yardstick of what this drafts.
"""

from __future__ import annotations

import time

from dsaserve.engine.request import Request, Status
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.speculative.adaptive import DraftLength
from dsaserve.engine.step import RowSpan


class DSparkDrafter:
    def __init__(
        self, runner: ModelRunner, length: DraftLength, vocab_size: int, noise_token_id: int
    ) -> None:
        self.runner, self.length, self.vocab_size = runner, length, vocab_size
        self.noise = noise_token_id
        self.gamma = length.max
        self._samplers: list[Request] = []

    def before_hand_out(
        self, samplers: list[Request], counts: list[int], emitted: list[list[int]], k: int
    ) -> None:
        """Nothing to do before the hand-out (the step wrote the context); remembers who
        sampled."""
        self._samplers = samplers

    def propose(self, k: int) -> None:
        """A draft block for every sampler still decoding; up to its remaining tokens' worth of
        drafts kept in `draft_token_ids`, their confidences in `draft_confidences`."""
        want = [
            (req, min(self.gamma, req.max_tokens - len(req.output_token_ids) - 1))
            for req in self._samplers
            if req.status is (Status.HELD if req.prefill_only else Status.RUNNING)
        ]
        want = [(req, n) for req, n in want if n > 0]
        if not want:
            return
        t0, gamma = time.perf_counter(), self.gamma
        per_pass = max(1, self.runner.pool.scratch_rows // gamma)
        for at in range(0, len(want), per_pass):
            chunk = want[at : at + per_pass]
            spans = [
                RowSpan(req.num_computed, gamma, req.slab_row,
                        [req.output_token_ids[-1]] + [self.noise] * (gamma - 1))
                for req, _ in chunk
            ]  # fmt: skip
            drafts, confidences = self.runner.call("draft_block", spans, self.vocab_size)
            ids = drafts.tolist()
            conf = confidences.tolist() if confidences is not None else [[]] * len(chunk)
            for (req, n), d, c in zip(chunk, ids, conf, strict=True):
                assert req.num_computed == req.num_tokens - 1  # (the anchor: its newest token)
                req.draft_token_ids, req.draft_confidences = d[:n], c[:n]
        self.length.time_draft(len(want) * gamma, time.perf_counter() - t0)
