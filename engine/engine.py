"""LLMEngine: one model, its KV pools, a scheduler and a runner, driven one step at a time.

Not thread-safe: one thread owns an engine (services drive it through `EngineLoop`).
Besides plain requests it supports the two halves of disaggregated serving:
- prefill only: `add_request(..., prefill_only=True)` stops after the first token and holds
  the KV (`held_kv`) until `release`;
- decode of a transferred request: `reserve` allocates KV units for it, a transfer fills
  them, `join` starts decoding.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv_pool import KVCacheConfig, KVPool
from engine.request import Request, Status
from engine.runner import ModelRunner
from engine.sampler import sample
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.text_stream import TextStream
from engine.tokenizer import Tokenizer
from engine.weights import build_model, load_weights

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 512 << 20
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class RequestError(ValueError):
    """A request this engine cannot serve as asked; the message says what to change."""


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"                  # "float32" | "bfloat16"
    kv_cache_memory: int | None = None      # bytes; None: a share of free GPU memory (CPU: 512 MiB)
    gpu_memory_utilization: float = 0.9
    page_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    context_length: int | None = None       # None: the model's max_position_embeddings
    cuda_graphs: bool = True
    cpu_threads: int = 1                    # intra-op threads on CPU (small models lose with more)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str                               # new text since the last output
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class HeldKV:
    """Where a prefilled request's state lives (for a reader on another worker)."""

    units: dict[str, list[int]]            # pool group -> unit ids ("slab" -> [row])
    num_tokens: int


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig = EngineConfig()) -> None:
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        self.config, self.model_dir = config, str(model_dir)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | self.tokenizer.eos_token_ids
        self.context_length = config.context_length or cfg.max_position_embeddings
        dtype = _DTYPES[config.dtype]
        self.model = build_model(cfg, dtype, self.device)
        load_weights(self.model, model_dir)
        kv_cfg = KVCacheConfig(memory_bytes=self._kv_budget(), page_size=config.page_size,
                               max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        self.pool = KVPool(cfg, kv_cfg, dtype=dtype, device=self.device, max_context=self.context_length)
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool, self.device, self.context_length)
        log.info("KV pool: %d pages (%s), one request up to %d tokens, layout %s", self.pool.num_total_pages,
                 ", ".join(f"{g}={p.num_pages - 1}" for g, p in self.pool.groups.items()),
                 self.pool.token_capacity(), self.pool.layout_description())
        if self.device.type == "cuda" and config.cuda_graphs and dtype is torch.bfloat16:
            # (torch's grouped GEMM of other dtypes syncs with the host on CUDA: eager there)
            sizes = [b for b in DEFAULT_GRAPH_BATCH_SIZES if b <= config.max_num_seqs]
            self.runner.capture_decode_graphs(sizes)
        self._held: dict[str, Request] = {}

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        # Leave (1 - utilization) of the card, plus headroom for activations and graphs.
        return max(0, int(free - total * (1 - self.config.gpu_memory_utilization) - (2 << 30)))

    # ---------------------------------------------------------------- requests

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, prefill_only: bool = False) -> Request:
        """Validate a request and build its state (not yet queued)."""
        if request_id in self.scheduler.requests or request_id in self._held:
            raise RequestError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if n == 0:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        if n >= self.context_length:
            raise RequestError(f"the prompt has {n} tokens; the context length is {self.context_length}, "
                               "which must leave room for at least one output token")
        if params.max_tokens is not None and n + params.max_tokens > self.context_length:
            raise RequestError(f"this model's context length is {self.context_length} tokens, but {n + params.max_tokens} "
                               f"were requested ({n} in the prompt, {params.max_tokens} for the output); "
                               "shorten the prompt or lower max_tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.context_length - n
        needed_tokens = n + max_tokens - 1
        for g, group in self.pool.groups.items():
            need, have = self.pool.pages_for(g, needed_tokens), group.num_pages - 1
            if need > have:
                raise RequestError(f"{needed_tokens} tokens need {need} pages of the {g!r} KV pool, which has {have}; "
                                   "lower max_tokens or give the worker more KV memory (--kv-cache-memory)")
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                       max_tokens=max_tokens, text=TextStream(self.tokenizer, params.stop),
                       eos_token_ids=self.eos_token_ids, prefill_only=prefill_only)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, prefill_only: bool = False) -> None:
        self.scheduler.add(self.new_request(request_id, prompt_token_ids, params, prefill_only=prefill_only))

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its KV; False if unknown or already finished."""
        req = self._held.pop(request_id, None) or self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, "abort")
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---------------------------------------------------------------- disaggregation

    def held_kv(self, request_id: str) -> HeldKV:
        req = self._held[request_id]
        return HeldKV(units={**req.block_tables, "slab": [req.slab]}, num_tokens=req.num_computed)

    def release(self, request_id: str) -> bool:
        """Free the KV a prefill-only request holds (its reader is done, or gave up)."""
        req = self._held.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, req.finish_reason or "stop")
        return True

    def reserve(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                params: SamplingParams) -> HeldKV | None:
        """Allocate KV units for a prefilled request (prompt KV computed elsewhere, first token
        already sampled and sent); None when the pools are full right now."""
        req = self.new_request(request_id, prompt_token_ids, params)
        # Replay the first token so stop strings and text offsets continue where prefill left off.
        reason = req.append_token(first_token_id)
        req.text.take(finished=reason is not None)
        if reason is not None:
            raise RequestError(f"request {request_id!r} already finished at its first token ({reason})")
        if not self.scheduler.reserve(req):
            return None
        return HeldKV(units={**req.block_tables, "slab": [req.slab]}, num_tokens=len(prompt_token_ids))

    def join(self, request_id: str) -> None:
        """The reserved request's KV has arrived: decode it from the next step on."""
        req = self.scheduler.requests[request_id]
        req.num_computed = len(req.prompt_token_ids)
        self.scheduler.join(req)

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        samplers, logits = self.runner.execute(batch)
        if not samplers:
            return []
        if self.tokenizer.vocab_size < logits.shape[1]:
            # A padded embedding has rows no token maps to; never sample them.
            logits[:, self.tokenizer.vocab_size :] = float("-inf")
        draws = [len(r.output_token_ids) for r in samplers]
        tokens = sample(logits, [r.params for r in samplers], draws)
        outputs = []
        for req, token in zip(samplers, tokens):
            reason = req.append_token(token)
            finished = reason is not None
            if req.prefill_only and req.status is Status.RUNNING:
                # One token is all a prefill worker samples; the KV stays for the decode worker.
                self.scheduler.hold(req)
                if finished:
                    self.scheduler.finish(req, reason)
                else:
                    self._held[req.request_id] = req
            elif finished:
                self.scheduler.finish(req, reason)
            outputs.append(RequestOutput(
                request_id=req.request_id, new_token_ids=[token], text=req.text.take(finished),
                finished=finished or req.prefill_only, finish_reason=reason, prompt_tokens=len(req.prompt_token_ids),
                completion_tokens=len(req.output_token_ids)))
        return outputs

    # ---------------------------------------------------------------- scoring

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one causal forward over token_ids (no sampling)."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        req = self.new_request("__score__", token_ids, SamplingParams(max_tokens=1))
        if not self.scheduler.try_allocate(req, len(token_ids)):
            raise RequestError(f"{len(token_ids)} tokens do not fit in the KV pools")
        try:
            chunks, step = [], self.config.max_num_batched_tokens
            for start in range(0, len(token_ids), step):
                part = token_ids[start : start + step]
                chunks.append(self.runner.forward_all_rows(
                    [(start, len(part), req.slab, part)], 0))
            return torch.cat(chunks)
        finally:
            self.scheduler.free_kv(req)

    def kv_usage(self) -> tuple[int, int]:
        """(free, total) pages over all pools."""
        return self.pool.num_free_pages, self.pool.num_total_pages

