"""Structured outputs in the engine: each constrained request's grammar state, and the token
bitmask of a step's constrained rows, filled on the host and applied on the device.

A request whose `SamplingParams.grammar` is set gets a `GrammarState`: an llguidance matcher of
that grammar (compiled once per grammar text, `engine.text.grammar`) and how many of the
request's output tokens it has consumed. Before a step samples, `Constraints.bitmask` brings
each constrained row's matcher up to the request's tokens and asks it which tokens may come
next: one bit per token id, 32 to an int32, EOS set only where the grammar is complete. The
sampler masks the other logits to -inf on the device (`engine.sampler`).

Because the state is rebuilt from the tokens, wherever they were sampled, a request resumes its
grammar anywhere: the decode worker of a disaggregated request replays the first token (sampled
under the same grammar by the prefill worker) into a fresh matcher, as it replays it into the
detokenizer. With async scheduling the newest token of a request may still be on the device when
the next step is launched; the engine then waits for it after launching that step's forward (the
mask is filled while the device runs the forward), never before. Forced tokens (a call's tags)
are decoded one step each; fast-forwarding them (llguidance's `compute_ff_tokens`) is not done.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.text.grammar import GrammarCompiler
from dsaserve.engine.text.tokenizer import Tokenizer


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0  # output tokens the matcher has read

    def advance(self, output_token_ids: list[int]) -> None:
        """Read the output tokens not read yet. A token the grammar refuses (a stop token id
        the grammar did not expect) leaves the matcher in its error state, which allows EOS
        only: the request ends rather than writing what the grammar forbids."""
        for token in output_token_ids[self.consumed :]:
            self.matcher.consume_token(token)
        self.consumed = len(output_token_ids)


@dataclass(frozen=True)
class Bitmask:
    """Which tokens the constrained rows of a step may sample, on the device."""

    rows: torch.Tensor  # [R] int64: the rows of the step's logits it constrains
    bits: torch.Tensor  # [R, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 = token t allowed


class Constraints:
    """An engine's grammars: compiled on first use (building llguidance's view of a tokenizer
    reads its whole vocabulary), each then kept for the requests that use it again. `state` may
    be called from any thread: a worker compiles a request's grammar before the request reaches
    the engine's thread, which then only steps."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # (the compiler is made once, by whichever thread first)
        self._executor: llguidance.LLExecutor | None = None

    def state(self, grammar: str) -> GrammarState:
        """A new request's state at the grammar's start; GrammarError if it does not compile."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, frozenset(self._eos))
        return GrammarState(self._compiler.matcher(grammar))

    def bitmask(self, rows: list[tuple[int, GrammarState]], device: torch.device) -> Bitmask | None:
        """The bitmask of (row, state) pairs whose states have read their requests' tokens;
        None for no rows. Filled on the host in llguidance's threads, copied without waiting."""
        if not rows:
            return None
        assert self._compiler is not None  # (a state exists only once compiled)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self._compiler.vocab_size + 31) // 32
        host = torch.zeros((len(rows), words), dtype=torch.int32)  # [R, W]
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(s.matcher, i) for i, (_, s) in enumerate(rows)], host
        )
        for i, (_, state) in enumerate(rows):
            if state.matcher.is_error():  # nothing may follow: end the request
                host[i] = 0
                for eos in self._eos:
                    host[i, eos // 32] |= _bit(eos % 32)
        return Bitmask(
            rows=to_device([row for row, _ in rows], torch.int64, device),
            bits=host.pin_memory().to(device, non_blocking=True)
            if device.type == "cuda"
            else host.to(device),
        )


def _bit(position: int) -> int:
    """Bit `position` of an int32 word as a Python int in int32's range."""
    return -(2**31) if position == 31 else 1 << position


def apply_bitmask(logits: torch.Tensor, mask: Bitmask) -> torch.Tensor:
    """logits [B, V] with the tokens `mask` forbids at -inf in its rows: a new tensor (the
    caller's logits stay the raw distribution logprobs are read from). Token ids past the mask
    (a padded vocabulary's rows) are forbidden too."""
    words = mask.bits.shape[1]
    vocab = min(logits.shape[1], words * 32)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = (mask.bits[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = allowed.reshape(len(mask.rows), words * 32)[:, :vocab].bool()  # [R, vocab]
    rows = torch.full((len(mask.rows), logits.shape[1]), float("-inf"), device=logits.device)
    rows[:, :vocab] = logits[mask.rows, :vocab].masked_fill(~allowed, float("-inf"))
    masked = logits.clone()
    masked[mask.rows] = rows
    return masked
