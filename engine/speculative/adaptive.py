"""How many drafts a step asks for (engine.speculative.config's `adaptive`)."""

from __future__ import annotations

from engine.speculative.config import SpeculativeConfig
from engine.speculative.stats import SpecDecodeStats


class DraftLength:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.max = spec.num_speculative_tokens
        self.adaptive = spec.adaptive

    def choose(self, num_running: int, stats: SpecDecodeStats) -> int:
        """Drafts per request for the next step (0..K)."""
        return self.max
