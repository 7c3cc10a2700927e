"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))` and `.score(ids)`.

`LLM(..., tensor_parallel_size=N)` spans N processes (GPUs); `close()` (or a `with` block)
stops the other N-1, which otherwise end with this process. One such engine runs in a process
at a time. `LLM(..., data_parallel_size=D, enable_expert_parallel=True)` runs D such engines
(engine.data_parallel), the prompts spread over them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.data_parallel import DataParallelEngines
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.logprobs import TokenLogprobs
from dsaserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the params asked
    # one per prompt token after the first, when the params asked (prompt_logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (vLLM's name)


class LLM:
    def __init__(
        self,
        model_dir: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        **engine_options: Any,
    ) -> None:
        spec = engine_options.get("speculative_config")
        if isinstance(spec, dict):  # vLLM's LLM takes it as a dict, the flag as JSON
            engine_options["speculative_config"] = json.dumps(spec)
        config = EngineConfig(device=device, dtype=dtype, **engine_options)
        self.engine: LLMEngine | DataParallelEngines = (
            DataParallelEngines(model_dir, config)
            if config.data_parallel_size > 1
            else LLMEngine(model_dir, config)
        )
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Result]:
        """Generate for every prompt (token-id list or text) in one continuous batch."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [cast(Prompt, prompts)]
        prompts = cast(Sequence[Prompt], prompts)
        params = params if params is not None else SamplingParams()
        params = params if isinstance(params, list) else [replace(params) for _ in prompts]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [
            self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in prompts
        ]
        keys = [f"offline-{i}" for i in range(len(ids))]
        for key, prompt, p in zip(keys, ids, params, strict=True):
            self.engine.add_request(key, prompt, p)
        tokens: dict[str, list[int]] = {k: [] for k in keys}
        texts: dict[str, list[str]] = {k: [] for k in keys}
        logprobs: dict[str, list[TokenLogprobs]] = {k: [] for k in keys}
        prompt_logprobs: dict[str, list[TokenLogprobs] | None] = dict.fromkeys(keys)
        reasons: dict[str, str] = {}
        cached: dict[str, int] = dict.fromkeys(keys, 0)
        try:
            while len(reasons) < len(keys):
                for out in self.engine.step():
                    tokens[out.request_id] += out.new_token_ids
                    texts[out.request_id].append(out.text)
                    logprobs[out.request_id] += out.logprobs or []
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    cached[out.request_id] = out.cached_tokens
                    if out.finished:
                        assert out.finish_reason is not None  # (a finished output says why)
                        reasons[out.request_id] = out.finish_reason
        finally:
            for key in keys:
                if key not in reasons:
                    self.engine.abort(key)
        return [
            Result(
                prompt_token_ids=p,
                token_ids=tokens[k],
                text="".join(texts[k]),
                finish_reason=reasons[k],
                logprobs=logprobs[k] if q.logprobs is not None else None,
                prompt_logprobs=prompt_logprobs[k],
                num_cached_tokens=cached[k],
            )
            for k, p, q in zip(keys, ids, params, strict=True)
        ]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of one causal forward over token_ids; vocab: the
        tokenizer's (a padded embedding's rows past it are no tokens)."""
        return self.engine.score(list(token_ids))[:, : self.tokenizer.vocab_size]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
