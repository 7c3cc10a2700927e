"""All state of one request inside an engine: tokens, KV ownership, sampling, text, listener.

The scheduler moves `Request` objects between its queues, the pool allocator fills their page
tables, the runner reads them and the engine loop hands their outputs to their listener: one
object per request, found by id in `Scheduler.requests`, and nowhere else.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsaserve.engine.kv.layout import SLAB
from dsaserve.engine.logits_processors import RowTokens, reads_ids
from dsaserve.engine.logprobs import TokenLogprobs
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.engine.step import sampled_ref
from dsaserve.engine.structured import GrammarState
from dsaserve.engine.text.text_stream import TextStream


class RequestError(ValueError):
    """A request this engine cannot serve as asked; the message says what to change."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the last output
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # With the first token, when the request asked: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache instead of computed
    # vLLM's stop_reason, once finished by one: the stop string or the stop token id
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class KVPages:
    """Where a request's KV state lives: for a reader on another worker, or a transfer's target."""

    pages: dict[str, list[int]]  # pool group -> page ids in logical order ("slab" -> [row])
    num_tokens: int  # tokens whose KV the pages hold
    # speculative decoding: the draft head's drafts after the first token, which the reader's
    # first step verifies (the prefill worker drafts as a local engine does after a prefill),
    # and DSpark's confidence in each (empty without a confidence head)
    draft_token_ids: tuple[int, ...] = ()
    draft_confidences: tuple[float, ...] = ()
    # a transfer's target: the first tokens whose full entry pages it shares from its engine's
    # prefix cache, which the transfer leaves alone (KVPool.missing)
    reused_tokens: int = 0


Listener = Callable[[RequestOutput], None]


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV
    RESERVED = "reserved"  # holds pages that a transfer is filling (disaggregated decode)
    RUNNING = "running"  # scheduled every step until it finishes
    HELD = "held"  # finished prefill; KV pinned for a reader (disaggregated prefill)
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens capped by the context length
    text: TextStream
    eos_token_ids: frozenset[int]
    # Prefill-only (prefill worker): stop after the first token and keep the KV for a reader
    # (engine.handoff)
    prefill_only: bool = False
    # Called on the engine thread with each of this request's outputs (services stream them).
    listener: Listener | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by steps still running on the device (async scheduling): they count in
    # num_tokens, but their ids are not on the host yet (at most one when a step is scheduled;
    # two between launching a step and completing the one before it).
    num_inflight: int = 0
    inflight_row: int = 0  # the newest one's row in its step's sampled ids
    num_computed: int = 0  # tokens whose KV is in the pool
    # speculative decoding: the draft head's drafts of the tokens after the newest, which the
    # next step verifies (never counted in num_tokens), and (DSpark's confidence head) the
    # chance of each being accepted given the ones before were
    draft_token_ids: list[int] = field(default_factory=list)
    draft_confidences: list[float] = field(default_factory=list)
    page_tables: dict[str, list[int]] = field(default_factory=dict)  # pool group -> page ids
    slab: int | None = None  # the request's slab row (its compressor rings, its page tables)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # vLLM's stop_reason: the stop string or stop token id that ended it (None: EOS, length)
    stop_reason: str | int | None = None
    # Prefix cache: hashes of its known tokens' whole blocks (engine.prefix_cache.block_hash),
    # and the prompt tokens its first admission resumed from the cache (None until then)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # where its tokens part from a cached prefix that no checkpoint of its marks: its prefill
    # takes one there too (None: nowhere worth it)
    branch_point: int | None = None
    grammar: GrammarState | None = None  # structured output: where the output is in its grammar
    bad_words: list[list[int]] = field(default_factory=list)  # params.bad_words' token ids
    # params.prompt_logprobs: those of prompt tokens 1.. computed so far (a chunk at a time)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def slab_row(self) -> int:
        """The slab row of a request that holds KV (scheduled, held or reserved)."""
        assert self.slab is not None, f"request {self.request_id!r} holds no KV"
        return self.slab

    def kv_pages(self) -> dict[str, list[int]]:
        """Its pages by pool group and its slab row under "slab" (as KVPages holds them)."""
        return {**self.page_tables, SLAB: [self.slab_row]}

    def sampling_row(self, drafts: Sequence[int] = ()) -> RowTokens:
        """What its next token's logits processors read (engine.logits_processors), `drafts`
        standing before it (a speculative step's verified rows); its ids are complete only
        while none is in flight."""
        ids = [*self.output_token_ids, *drafts] if reads_ids(self.params) else []
        return RowTokens(
            params=self.params,
            prompt=self.prompt_token_ids,
            output=ids,
            num_output=len(self.output_token_ids) + len(drafts) + self.num_inflight,
            stop_ids=self.stop_ids,
            bad_words=self.bad_words,
        )

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens min_tokens keeps out: EOS (unless ignored) and the stop tokens."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """token_ids[start:start + n] without building the whole list (decode steps stay O(1));
        a token still on the device (the newest, in flight) is its `sampled_ref`."""
        known = self.num_tokens - self.num_inflight
        if start + n > known:
            assert start + n == known + 1 == self.num_tokens, "only the newest token may be unknown"
            return self.tokens(start, n - 1) + [sampled_ref(self.inflight_row)]
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        return (
            self.prompt_token_ids[start : start + n]
            + self.output_token_ids[: max(0, start + n - p)]
        )

    def lookback(self, start: int, depth: int) -> tuple[int, ...]:
        """The `depth` tokens before position `start` (fewer at the sequence's start): what a
        chunk from `start` reads of the tokens before it (RowSpan.lookback). Known on the host
        whenever `start` is scheduled: only the newest token may be in flight, and a chunk
        starts at it at the latest."""
        first = max(0, start - depth)
        return tuple(self.tokens(first, start - first))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def ends_in_flight(self) -> bool:
        """Its last token (the max_tokens-th) is in flight: there is nothing more to compute."""
        return self.num_inflight > 0 and len(self.output_token_ids) + self.num_inflight >= (
            self.max_tokens
        )

    @property
    def num_pending(self) -> int:
        """Known tokens whose KV is not computed yet (the last one's logits give the next token)."""
        return self.num_tokens - self.num_computed

    def append_token(self, token_id: int, in_flight: bool = False) -> str | None:
        """Record a sampled token (in_flight: the oldest in-flight one, now on the host); returns
        the finish reason if the request ends with it. Nothing but the length ends it before
        params.min_tokens tokens (the sampler never draws EOS or a stop token until then)."""
        self.num_inflight -= in_flight
        self.output_token_ids.append(token_id)
        stops = len(self.output_token_ids) >= self.params.min_tokens
        is_eos = token_id in self.eos_token_ids and not self.params.ignore_eos
        if stops and (is_eos or token_id in self.params.stop_token_ids):
            self.stop_reason = None if is_eos else token_id
            return "stop"
        self.text.push(token_id, search=stops)
        if self.text.stopped:
            self.stop_reason = self.text.stopped
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None
