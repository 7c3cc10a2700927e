"""How a checkpoint turns an OpenAI chat into prompt text, without torch.

A checkpoint with a chat template (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json) renders it, as transformers and vLLM do. The DeepSeek-V4 and V3.2 releases
ship none: their `encoding/encoding_dsv4.py` and `encoding_dsv32.py` are the formats, so a V4
checkpoint (config.json `model_type: deepseek_v4`) without a template uses
`engine.text.chat.encode_messages`, a V3.2 one (`deepseek_v32`) `encode_messages_dsv32`. Anything
else has no chat format, and says so when asked to render one. Each format also says how its
model writes tool calls (`dialect`: the DSML block's name, which the reply parser reads).

The router (tokenizing requests) and `dsaserve generate --chat` both call `chat_format`, so
a chat becomes the same prompt wherever it is rendered.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsaserve.engine.model_dir import read_config
from dsaserve.engine.text.chat import ChatEncodingError, encode_messages
from dsaserve.engine.text.chat.dsml import V4_DSML, V32_DSML, Dialect
from dsaserve.engine.text.chat.encoding_dsv32 import encode_messages_dsv32
from dsaserve.engine.text.chat.tokens import LATEST_REMINDER, THINK_END, THINK_START
from dsaserve.engine.text.template import ChatTemplateError
from dsaserve.engine.text.tokenizer import Tokenizer

V4_MODEL_TYPE = "deepseek_v4"
V32_MODEL_TYPE = "deepseek_v32"
# The V4 encoder's own arguments that a request may set through `chat_template_kwargs`
# (besides the thinking switch, which `ChatOptions.thinking` carries).
V4_KWARGS = ("thinking", "enable_thinking", "drop_thinking")
V32_KWARGS = ("thinking", "enable_thinking")  # (V3.2's only drops reasoning it never renders)
# How each family writes tool calls, also under a template of the checkpoint's own.
DIALECTS = {V4_MODEL_TYPE: V4_DSML, V32_MODEL_TYPE: V32_DSML}


@dataclass(frozen=True)
class ChatOptions:
    """How to render one chat, beyond its messages and tools."""

    thinking: bool = False  # open the reply in reasoning (V4: thinking mode, ending `<think>`)
    # The V4 encoder's: None, "high" or "max" (in thinking mode); a template reads it as
    # `reasoning_effort` when set.
    reasoning_effort: str | None = None
    # More template variables (a request's `chat_template_kwargs`); the V4 encoder takes only
    # V4_KWARGS.
    variables: Mapping[str, Any] = field(default_factory=dict)


class ChatFormat(Protocol):
    name: str  # for messages: "the chat template", "the DeepSeek-V4 encoder"
    dialect: Dialect  # how the model writes tool calls (the reply parser's grammar)

    @property
    def renders_tools(self) -> bool:
        """Whether `tools` reach the prompt (a template that never reads them would drop them)."""
        ...

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; raises ChatTemplateError (ChatEncodingError for the V4 encoder,
        which names the offending field in `param`) for a chat it cannot render."""
        ...


def chat_format(model_dir: str | os.PathLike, tokenizer: Tokenizer) -> ChatFormat:
    """The checkpoint's chat format: its template if it has one, else the release's encoder for
    a V4 or V3.2 checkpoint, else one that refuses every chat."""
    model_type = str(read_config(model_dir).get("model_type"))
    if tokenizer.has_chat_template:
        return TemplateChat(tokenizer, DIALECTS.get(model_type, V4_DSML))
    if model_type == V4_MODEL_TYPE:
        return V4Chat()
    if model_type == V32_MODEL_TYPE:
        return V32Chat()
    return TemplateChat(tokenizer, V4_DSML)  # no template: says so on every render


def opens_reasoning(prompt: str) -> bool:
    """Whether the reply to `prompt` starts inside the reasoning: the prompt opened it, as V4's
    thinking mode (and DeepSeek templates in thinking mode) end with `<think>`, or with `<think>`
    and then the V4 release's reminders (which the model reads inside its reasoning)."""
    _, think, tail = prompt.rpartition(THINK_START)
    reminders_only = tail.startswith(LATEST_REMINDER) and THINK_END not in tail
    return bool(think) and (tail == "" or reminders_only)


class TemplateChat:
    name = "the chat template"

    def __init__(self, tokenizer: Tokenizer, dialect: Dialect) -> None:
        self._tokenizer, self.dialect = tokenizer, dialect

    @property
    def renders_tools(self) -> bool:
        return "tools" in self._tokenizer.chat_template_variables

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
        add_generation_prompt: bool = True,
    ) -> str:
        # Both spellings of the thinking switch that DeepSeek and Qwen templates read, then the
        # request's own variables; a template that reads neither is unaffected.
        variables: dict[str, Any] = {
            "thinking": options.thinking,
            "enable_thinking": options.thinking,
        }
        if options.reasoning_effort is not None:
            variables["reasoning_effort"] = options.reasoning_effort
        return self._tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=None if tools is None else list(tools),
            variables={**variables, **options.variables},
        )


class V4Chat:
    name = "the DeepSeek-V4 encoder"
    renders_tools = True
    dialect = V4_DSML

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
        add_generation_prompt: bool = True,
    ) -> str:
        _check_release_options(self.name, V4_KWARGS, options, add_generation_prompt)
        drop_thinking = options.variables.get("drop_thinking", True)
        if not isinstance(drop_thinking, bool):
            raise ChatEncodingError("chat_template_kwargs.drop_thinking", "must be a boolean")
        return encode_messages(
            messages,
            thinking=options.thinking,
            reasoning_effort=options.reasoning_effort if options.thinking else None,
            tools=tools,
            drop_thinking=drop_thinking,
        )


class V32Chat:
    """DeepSeek-V3.2's encoder. It has one thinking level: a reasoning effort only turns
    thinking on (the router's mapping), and the encoder adds nothing for it."""

    name = "the DeepSeek-V3.2 encoder"
    renders_tools = True
    dialect = V32_DSML

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
        add_generation_prompt: bool = True,
    ) -> str:
        _check_release_options(self.name, V32_KWARGS, options, add_generation_prompt)
        return encode_messages_dsv32(messages, thinking=options.thinking, tools=tools)


def _check_release_options(
    name: str, kwargs: tuple[str, ...], options: ChatOptions, add_generation_prompt: bool
) -> None:
    """What a release's encoder refuses: no generation prompt (it always ends a chat where the
    assistant starts), and chat_template_kwargs beyond its own `kwargs`."""
    if not add_generation_prompt:
        raise ChatEncodingError(
            "add_generation_prompt",
            f"must be true: {name} always ends a chat where the assistant starts to answer",
        )
    unknown = sorted(set(options.variables) - set(kwargs))
    if unknown:
        raise ChatEncodingError(
            f"chat_template_kwargs.{unknown[0]}",
            f"is not an option of {name}; it takes {', '.join(kwargs)} (and the request's "
            "reasoning_effort)",
        )


__all__ = [
    "ChatEncodingError",
    "ChatFormat",
    "ChatOptions",
    "ChatTemplateError",
    "chat_format",
    "opens_reasoning",
]
