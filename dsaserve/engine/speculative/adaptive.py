"""How many drafts the next step verifies (`"adaptive": true` in --speculative-config).

Verification pays per row: a step that verifies k drafts for each of B requests computes
B (1 + k) target rows, and drafting them costs the MTP layer's passes. At one request the rows
are nearly free (a decode step is bound by reading weights) and every accepted draft saves a
whole step; at high concurrency the step is bound by its rows and rejected drafts cost what
they would save (why SGLang turns MTP off there). The rule, once per step:

    c_i      acceptance of draft position i given position i - 1 was accepted (measured:
             exponential averages of the engine's counters, optimistic before any)
    E(k)   = 1 + sum_{i<=k} prod_{j<=i} c_j        tokens a request emits per step with k
    T(k)   = target(B (1 + k)) + [k > 0] draft(B (1 + k) + (k - 1) B)
             seconds of one step: the target step over its rows, the MTP layer's first pass
             over the same rows and its k - 1 further passes of B rows (least-squares lines
             in rows, fitted to the steps timed so far)
    k*     = argmax_{0 <= k <= K} E(k) B / T(k)   (tokens per second of the batch)

k* = 0 skips the MTP layer altogether (its KV state at the positions skipped stays stale: drafts
after it are worse for a window, never wrong: verification keeps every token exact). Until both
lines have two distinct batch sizes to fit, K is used.

DSpark drafts its whole block in one pass whatever is verified, and its confidence head says,
per request and position, how likely each draft is accepted: c_{r,i} (or, without the head, the
measured c_i). So the choice is per request (`verify_lengths`), after drafting: with
v_{r,i} = prod_{j<=i} c_{r,j} the chance draft i of request r is emitted, the batch emits
B + sum of the verified v's for target(B + verified drafts) + draft(B gamma) seconds, and the
drafts worth verifying are the largest v's while each adds more than the batch's rate pays for
its row: v > slope * tokens / seconds (the line's slope: a row's cost). Each request's v's fall
along its block, so the chosen ones are a prefix of it; none (0) where a row costs more than its
draft is likely to emit.
"""

from __future__ import annotations

from dsaserve.engine.speculative.config import SpeculativeConfig
from dsaserve.engine.speculative.stats import SpecDecodeStats

_DECAY = 0.9  # weight of the past in the acceptance averages
_PRIOR = 0.7  # acceptance assumed before any is measured


class _Line:
    """Least-squares seconds = a + b * rows over the timed steps (decayed, so it follows)."""

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0
        self.rows: set[int] = set()

    def add(self, rows: int, seconds: float) -> None:
        for attr, v in (("n", 1.0), ("x", rows), ("y", seconds), ("xx", rows * rows),
                        ("xy", rows * seconds)):  # fmt: skip
            setattr(self, attr, getattr(self, attr) * 0.98 + v)
        self.rows.add(rows)

    @property
    def ready(self) -> bool:
        return len(self.rows) >= 2

    def __call__(self, rows: float) -> float:
        det = self.n * self.xx - self.x * self.x
        b = max((self.n * self.xy - self.x * self.y) / det, 0.0) if det else 0.0
        a = max((self.y - b * self.x) / self.n, 0.0)
        return a + b * rows


class DraftLength:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.max, self.adaptive = spec.num_speculative_tokens, spec.adaptive
        self.accept = [_PRIOR] * self.max  # c_i
        self.target, self.draft = _Line(), _Line()
        # the counters at the last update: accepted and verified drafts per position
        self._seen = ([0] * self.max, [0] * self.max)

    def time_target(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def time_draft(self, rows: int, seconds: float) -> None:
        self.draft.add(rows, seconds)

    def choose(self, batch: int, stats: SpecDecodeStats) -> int:
        """Drafts per request for the next step of `batch` requests (0..K)."""
        self._update(stats)
        if not self.adaptive or batch == 0 or not (self.target.ready and self.draft.ready):
            return self.max
        best, best_rate = self.max, 0.0
        for k in range(self.max + 1):
            emitted, run = 1.0, 1.0
            for c in self.accept[:k]:
                run *= c
                emitted += run
            rows = batch * (1 + k)
            cost = self.target(rows)
            if k:
                cost += self.draft(rows + (k - 1) * batch)
            rate = emitted * batch / max(cost, 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verify_lengths(
        self, confidences: list[list[float]], batch: int, stats: SpecDecodeStats
    ) -> list[int]:
        """How many of each drafting request's drafts the next step of `batch` running requests
        verifies; confidences[r]: request r's per draft (an empty list: use the measured
        acceptance for each of its K drafts)."""
        self._update(stats)
        # (the draft line may have one batch size only: its mean is all this rule reads)
        if not self.adaptive or not self.target.ready:
            return [self.max] * len(confidences)
        chances = []  # (v, request, position): prefix chances, falling along each block
        for r, conf in enumerate(confidences):
            v = 1.0
            for i, c in enumerate(conf or self.accept):
                v *= c
                chances.append((v, r, i))
        chances.sort(key=lambda t: (-t[0], t[2]))  # (ties by position: prefixes stay prefixes)
        tokens, rows = float(batch), batch
        seconds = self.target(rows) + self.draft(batch * self.max)
        slope = max(self.target(rows + 1) - self.target(rows), 1e-12)
        lengths = [0] * len(confidences)
        for v, r, i in chances:
            if v * seconds <= slope * tokens:
                break
            lengths[r], tokens, rows = i + 1, tokens + v, rows + 1
            seconds = self.target(rows) + self.draft(batch * self.max)
        return lengths

    def _update(self, stats: SpecDecodeStats) -> None:
        """Fold the counters' growth since the last call into the acceptance averages: c_i =
        drafts accepted at i / drafts verified at i whose position i - 1 was accepted."""
        accepted, verified = self._seen
        for i in range(self.max):
            offered = stats.drafts_per_pos[i] - verified[i]
            got = stats.accepted_per_pos[i] - accepted[i]
            reached = (stats.accepted_per_pos[i - 1] - accepted[i - 1]) if i else offered
            if offered and reached:
                rate = min(1.0, got / min(offered, reached))
                self.accept[i] = _DECAY * self.accept[i] + (1 - _DECAY) * rate
        self._seen = (list(stats.accepted_per_pos), list(stats.drafts_per_pos))
