"""The one model a router serves: its name, context length, chat format and prompt tokens.

Reads only the checkpoint's `config.json` and tokenizer files: `engine.text.tokenizer` and
`engine.text.chat_format` are torch-free, and so is everything this module touches. A chat
completion and /tokenize of the same chat both come here, so prefill gets exactly the ids
/tokenize shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

from dsaserve.engine.sampling_params import ContextLengthError, resolve_max_tokens
from dsaserve.engine.text.chat.tokens import THINK_END
from dsaserve.engine.text.chat_format import ChatEncodingError, ChatFormat, chat_format
from dsaserve.engine.text.grammar import GrammarCompiler
from dsaserve.engine.text.token_bound import min_tokens
from dsaserve.engine.text.tokenizer import Tokenizer
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.api.schemas import ChatPromptFields, CompletionRequest
from dsaserve.services.router.chat import ChatPrompt, chat_prompt


@dataclass(frozen=True)
class ServedModel:
    name: str
    context_length: int  # prompt + completion tokens: --max-model-len, or max_position_embeddings
    tokenizer: Tokenizer
    chat_format: ChatFormat
    # Bounds a prompt's token count from its length (None: this tokenizer allows no bound).
    max_chars_per_token: int | None
    # The `</think>` token, where it is one special token (what ends a reasoning), as the
    # grammars name it (engine.text.grammar: llguidance's view of the vocabulary)
    think_end_id: int | None
    default_thinking: bool = False  # a chat that does not say renders in thinking mode
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(
        cls,
        model_dir: str,
        served_name: str | None = None,
        max_model_len: int | None = None,
        default_thinking: bool = False,
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
        tokenizer = Tokenizer.from_pretrained(model_dir)
        return cls(
            name,
            limit,
            tokenizer,
            chat_format(model_dir, tokenizer),
            tokenizer.max_chars_per_token(),
            # (the compiler is let go at once: the router compiles in processes of its own)
            GrammarCompiler(tokenizer).special_token(THINK_END),
            default_thinking,
        )

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise APIError(
                404,
                f"The model '{requested}' does not exist; this server serves "
                f"'{self.name}' (see GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    async def chat_ids(self, request: ChatPromptFields) -> tuple[ChatPrompt, list[int]]:
        """The chat's prompt and its ids. Rendering and tokenizing run off the event loop (long
        prompts take milliseconds of CPU), and a prompt that cannot fit the context is refused
        before it is tokenized at all."""
        try:
            prompt = await asyncio.to_thread(
                chat_prompt, request, self.chat_format, default_thinking=self.default_thinking
            )
            self._check_fits(prompt.text, "messages")
            # The prompt holds bos already (the template or encoder wrote it).
            return prompt, await asyncio.to_thread(self.tokenizer.encode, prompt.text)
        except ChatEncodingError as e:  # names the field at fault
            raise APIError(400, f"Invalid {e}", param=e.param) from e
        except ValueError as e:  # ChatTemplateError, or text that is not valid Unicode
            raise APIError(400, f"Invalid messages: {e}", param="messages") from e

    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids; as in vLLM's completions API, special tokens (BOS) by default."""
        self._check_fits(text, "prompt")
        try:
            return await asyncio.to_thread(
                self.tokenizer.encode, text, add_special_tokens=add_special_tokens
            )
        except ValueError as e:
            raise APIError(400, f"Invalid prompt: {e}", param="prompt") from e

    async def completion_prompts(self, request: CompletionRequest) -> list[tuple[list[int], str]]:
        """Each prompt of a completion as (its ids, its text: as sent, or the ids decoded)."""
        prompts = []
        for i, prompt in enumerate(request.prompts()):
            if isinstance(prompt, str):
                ids = await self.text_ids(prompt, request.add_special_tokens)
                prompts.append((ids, prompt))
            else:
                self.check_ids(prompt, "prompt" if len(request.prompts()) == 1 else f"prompt[{i}]")
                prompts.append((list(prompt), self.tokenizer.decode(prompt)))
        return prompts

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise APIError(
                400,
                f"Token ids must be in [0, {self.tokenizer.vocab_size}); got {bad[:5]}",
                param=param,
            )

    def _check_fits(self, text: str, param: str) -> None:
        """Refuse `text` if even its fewest possible tokens leave no room for output."""
        if self.max_chars_per_token is None:
            return
        fewest = min_tokens(text, self.max_chars_per_token)
        if fewest >= self.context_length:
            raise APIError(
                400,
                f"This model's maximum context length is {self.context_length} tokens, but the "
                f"prompt has at least {fewest} tokens ({len(text)} characters), which leaves no "
                "room for output; shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def max_tokens(self, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """The completion budget: what was asked for, or by default the rest of the context."""
        try:
            return resolve_max_tokens(prompt_tokens, requested, self.context_length)
        except ContextLengthError as e:
            param = prompt_param if e.param == "prompt" else "max_tokens"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
