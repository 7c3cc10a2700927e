"""Request bodies of the OpenAI API subset the router serves (pydantic).

Field names and ranges follow OpenAI's schema; `top_k` and `ignore_eos` are the usual vLLM/SGLang
extensions. Only what a worker can honour is accepted: `n` must be 1, message content is text,
OpenAI fields the router does not implement pass only at values that change nothing
(`fields.py`), and unknown fields are refused by name. Every number fits its wire type
(proto/dsaserve.proto) and every string is valid Unicode, so building the gRPC request cannot
fail on anything a client sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from services.rpc import pb

from . import fields
from .fields import NoOp

MAX_STOP_STRINGS = 4
UINT32_MAX = 2**32 - 1  # max_tokens on the wire
INT32_MAX = 2**31 - 1  # top_k on the wire
INT64 = 2**63  # OpenAI's seed is a signed 64-bit integer
SEED_SPAN = 2**63  # the worker takes seeds in [0, 2**63) (a torch generator's range)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_unicode(text: str) -> str:
    # JSON escapes can smuggle half a UTF-16 pair into a str; it has no UTF-8 form, so neither
    # the tokenizer nor protobuf could take it.
    if (surrogate := _SURROGATE.search(text)) is not None:
        raise ValueError(
            f"the text is not valid Unicode: a lone UTF-16 surrogate "
            f"(\\u{ord(surrogate.group()):04x}) at index {surrogate.start()}"
        )
    return text


Text = Annotated[str, AfterValidator(_whole_unicode)]


class _Body(BaseModel):
    """A JSON object of the API: unknown fields refused, unimplemented ones only as no-ops."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    no_op_fields: ClassVar[Mapping[str, NoOp]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_no_ops(cls, data: object) -> object:
        return fields.drop_no_ops(data, cls.no_op_fields, lambda name: name in cls.model_fields)


class StreamOptions(_Body):
    no_op_fields = fields.STREAM_OPTIONS
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields shared by chat and text completions."""

    model: Text | None = None  # None = the one served model
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # -1 and 0 both mean off (vLLM accepts both)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: list[Text] = Field(default_factory=list)  # OpenAI also takes a single string
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: Text | None = None  # an end-user id for the provider's abuse monitoring: unused here

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(
                f"only n=1 is supported, got {n}; send separate requests for more choices"
            )
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: object) -> object:
        return [stop] if isinstance(stop, str) else [] if stop is None else stop

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str]) -> list[str]:
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
            )
        if "" in stop:
            raise ValueError("stop strings must not be empty")
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int) -> pb.SamplingParams:
        """The wire sampling params; unset fields stay unset so the worker applies its defaults."""
        params = pb.SamplingParams(
            max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos
        )
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.top_k is not None:
            params.top_k = max(self.top_k, 0)
        if self.seed is not None:
            # Folds OpenAI's signed seeds into the worker's range; equal seeds stay equal.
            params.seed = self.seed % SEED_SPAN
        return params


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    no_op_fields = fields.MESSAGE

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: object) -> object:
        # Before validation, so an image part is named as such, not as a malformed text part.
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(
                    f"only text content parts are supported, got type {part.get('type')!r}"
                )
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as the tokenizer takes it (it joins text parts the way vLLM does)."""
        if isinstance(self.content, list):
            return {
                "role": self.role,
                "content": [{"type": "text", "text": p.text} for p in self.content],
            }
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_GenerationRequest):
    no_op_fields = fields.CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    def requested_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when a client sends both.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_GenerationRequest):
    no_op_fields = fields.COMPLETION

    prompt: Text | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, prompt: object) -> object:
        """OpenAI also takes a batch of prompts; one is unwrapped, more are refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(
                    f"batched prompts are not supported ({len(prompt)} given); "
                    "send one prompt per request"
                )
            return prompt[0]
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt
