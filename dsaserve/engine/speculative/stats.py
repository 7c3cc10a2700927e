"""Counters of speculative decoding, in vLLM's shape (its SpecDecodingStats): drafts (requests
that verified at least one draft in a step), draft tokens, accepted tokens, and acceptances per
draft position; and, since a step may verify fewer drafts than the head proposed (adaptive),
the drafts verified per position, so each position's acceptance rate is accepted / verified
there. The worker exports them as `dsaserve_spec_decode_*` (mean acceptance length = 1 +
accepted / drafts); the profiler ranges `verify` and `draft` (engine.profile.ranges) name its
parts of a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: position i accepted
    drafts_per_pos: list[int] = field(default_factory=list)  # [K]: position i verified

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens
        self.drafts_per_pos = [0] * self.num_speculative_tokens

    def record(self, drafts: int, accepted: int) -> None:
        """One request's verification: `drafts` drafts of which the first `accepted` passed."""
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_per_pos[i] += 1
            for i in range(drafts):
                self.drafts_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying request emits per step: 1 + accepted drafts (vLLM's figure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
