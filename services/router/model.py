"""The one model a router serves: its name, context length, and prompt tokenization.

Reads only the checkpoint's `config.json` and tokenizer files: `engine.tokenizer` is torch-free,
and so is everything this module touches.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

from engine.sampling_params import ContextLengthError, resolve_max_tokens
from engine.tokenizer import Tokenizer

from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: str
    context_length: int  # prompt + completion tokens: --max-model-len, or max_position_embeddings
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(
        cls, model_dir: str, served_name: str | None = None, max_model_len: int | None = None
    ) -> ServedModel:
        config_path = os.path.join(model_dir, "config.json")
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the model config {config_path}: {e}") from e
        context_length = config.get("max_position_embeddings")
        if not isinstance(context_length, int) or context_length < 2:
            raise ValueError(
                f"{config_path}: max_position_embeddings must be an integer >= 2, "
                f"got {context_length!r}"
            )
        name = served_name or os.path.basename(os.path.normpath(model_dir))
        limit = max_model_len or context_length
        return cls(name, model_dir, limit, Tokenizer.from_pretrained(model_dir))

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise APIError(
                404,
                f"The model '{requested}' does not exist; this server serves "
                f"'{self.name}' (see GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    async def prompt_ids(self, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
        """Render and tokenize off the event loop: long prompts take milliseconds of CPU."""
        if isinstance(request, ChatCompletionRequest):
            messages = [m.for_template() for m in request.messages]
            try:
                return await asyncio.to_thread(
                    self.tokenizer.encode_chat, messages, add_generation_prompt=True
                )
            except ValueError as e:  # ChatTemplateError, or text that is not valid Unicode
                raise APIError(400, f"Invalid messages: {e}", param="messages") from e
        if isinstance(request.prompt, str):
            try:
                # As in vLLM's completions API, a text prompt gets the special tokens (BOS).
                return await asyncio.to_thread(
                    self.tokenizer.encode, request.prompt, add_special_tokens=True
                )
            except ValueError as e:
                raise APIError(400, f"Invalid prompt: {e}", param="prompt") from e
        bad = [t for t in request.prompt if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise APIError(
                400,
                f"Prompt token ids must be in [0, {self.tokenizer.vocab_size}); got {bad[:5]}",
                param="prompt",
            )
        return list(request.prompt)

    def max_tokens(self, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """The completion budget: what was asked for, or by default the rest of the context."""
        try:
            return resolve_max_tokens(prompt_tokens, requested, self.context_length)
        except ContextLengthError as e:
            param = prompt_param if e.param == "prompt" else "max_tokens"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
