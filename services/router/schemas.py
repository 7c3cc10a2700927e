"""Request bodies of the OpenAI API subset the router serves (pydantic; unknown fields ignored).

Field names and ranges follow OpenAI's schema; `top_k` and `ignore_eos` are the usual vLLM/SGLang
extensions. Only what a worker can honour is accepted: `n` must be 1, message content is text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.rpc import pb

MAX_STOP_STRINGS = 4
_UINT64 = 2**64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None = the one served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0 both mean off (vLLM accepts both)
    seed: int | None = Field(default=None, ge=-(2**63), lt=_UINT64)
    stop: list[str] = Field(default_factory=list)  # OpenAI also takes a single string
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

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
            params.seed = self.seed % _UINT64  # OpenAI seeds are signed 64-bit
        return params


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for part in content if isinstance(content, list) else []:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when a client sends both.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]

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
