"""How many drafts the next step asks for (`"adaptive": true` in --speculative-config).

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
        self._seen = (0, [0] * self.max)  # counters at the last update: drafts, per position
        self.offered = [0] * self.max  # drafts offered at each position (counted by `offer`)
        self._offered_seen = [0] * self.max

    def offer(self, drafts: int) -> None:
        """A request verifies `drafts` drafts this step (positions 0..drafts-1 offered)."""
        for i in range(drafts):
            self.offered[i] += 1

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

    def _update(self, stats: SpecDecodeStats) -> None:
        """Fold the counters' growth since the last call into the acceptance averages."""
        for i in range(self.max):
            offered = self.offered[i] - self._offered_seen[i]
            accepted = stats.accepted_per_pos[i] - self._seen[1][i]
            reached = (stats.accepted_per_pos[i - 1] - self._seen[1][i - 1]) if i else offered
            if offered and reached:
                rate = min(1.0, accepted / min(offered, reached))
                self.accept[i] = _DECAY * self.accept[i] + (1 - _DECAY) * rate
        self._seen = (stats.num_drafts, list(stats.accepted_per_pos))
        self._offered_seen = list(self.offered)
