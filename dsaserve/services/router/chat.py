"""A chat request's prompt: thinking, reasoning effort and tool choice resolved, then rendered by
the checkpoint's chat format (its Jinja template, or the DeepSeek-V4 release's encoder).

Thinking (the V4 encoder's thinking mode; `thinking` and `enable_thinking` for a template):

1. `chat_template_kwargs: {"thinking": bool}` or `{"enable_thinking": bool}` (vLLM's convention)
   when given;
2. else on exactly when `reasoning_effort` is given and is not "none" (the request's field, or
   `chat_template_kwargs.reasoning_effort`, as DeepSeek's own examples send it; both at once
   must agree);
3. else the router's `--default-thinking` (off unless set).

`reasoning_effort`, OpenAI's values onto DeepSeek-V4's two levels (as DeepSeek's own API maps
them): "none" -> thinking off; "minimal", "low", "medium", "high" -> thinking, effort "high"
(the encoder's default, which adds nothing to the prompt); "xhigh" and DeepSeek's "max" ->
thinking, effort "max" (the release's fixed reasoning-effort paragraph after BOS). A
`reasoning_effort` that contradicts an explicit thinking switch is a 400.

`tool_choice`:

- "auto" (the default with tools): the tools are in the prompt and the model decides; a call of
  a `strict` tool has arguments of its schema (constrained decoding, `structured`).
- "none": the tools are left out of the prompt, so the model answers in text.
- "required", or a named function (only that tool is rendered): the reply is constrained to a
  DSML call of those tools with arguments of their schemas, after the reasoning in thinking mode.
- `parallel_tool_calls: false` keeps the first call of a reply and drops any later one (and a
  constrained reply makes one call only).

A reply reads tool calls only where tools are offered: without them, DSML markup is text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.text.chat.constraint import ReplyConstraint, tool_schemas
from dsaserve.engine.text.chat.dsml import Dialect
from dsaserve.engine.text.chat_format import ChatFormat, ChatOptions, opens_reasoning
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.api.schemas import ChatPromptFields, NamedToolChoice

# OpenAI reasoning_effort -> (thinking, the V4 encoder's effort).
EFFORTS: Mapping[str, tuple[bool, str | None]] = {
    "none": (False, None),
    "minimal": (True, "high"),
    "low": (True, "high"),
    "medium": (True, "high"),
    "high": (True, "high"),
    "xhigh": (True, "max"),
    "max": (True, "max"),
}
_SWITCHES = ("thinking", "enable_thinking")
_EFFORT_KWARG = "reasoning_effort"  # chat_template_kwargs' spelling of the request's field


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # what is tokenized: the rendered chat
    opens_reasoning: bool  # the reply starts inside the reasoning
    dialect: Dialect  # how the model writes tool calls (the format's)
    # the tools the reply may call and how tool_choice constrains it (services.router.structured)
    calls: ReplyConstraint
    max_tool_calls: int | None  # 1 when parallel_tool_calls is false

    @property
    def offers_tools(self) -> bool:
        return bool(self.calls.tools)


def chat_prompt(
    request: ChatPromptFields, fmt: ChatFormat, *, default_thinking: bool
) -> ChatPrompt:
    """Raises APIError (400) for options that contradict each other or that the format lacks,
    ValueError for a chat the format cannot render."""
    choice = request.tool_choice
    thinking, effort = _thinking(request, default_thinking)
    tools = request.tool_dicts()
    if tools and choice == "none":
        tools = None
    elif isinstance(choice, NamedToolChoice):
        tools = [t for t in tools or [] if t["function"]["name"] == choice.function.name]
    if tools and not fmt.renders_tools:
        raise APIError(
            400,
            f"This model's chat format ({fmt.name}) does not render tools, so the model would "
            "never see them; send the request without tools.",
            param="tools",
        )
    variables = {
        k: v
        for k, v in (request.chat_template_kwargs or {}).items()
        if k not in (*_SWITCHES, _EFFORT_KWARG)
    }
    messages = [m.for_template() for m in request.messages]
    # A continued final message: the reply's turn opens as a new one's, then its text.
    prefill = messages.pop() if request.continue_final_message else None
    text = fmt.render(
        messages,
        tools=tools,
        options=ChatOptions(thinking=thinking, reasoning_effort=effort, variables=variables),
        add_generation_prompt=request.add_generation_prompt or prefill is not None,
    )
    if prefill is not None:
        if opens_reasoning(text):
            raise APIError(
                400,
                "An assistant prefill (the reply continuing the final assistant message) is not "
                "served in thinking mode: the prefill would be taken for reasoning. Turn "
                "thinking off or end the conversation with a user message.",
                param="messages",
            )
        text += _text_of(prefill["content"])
    named = isinstance(choice, NamedToolChoice)
    offered = {tool["function"]["name"] for tool in tools or []}
    calls = ReplyConstraint(
        tools=tuple(t for t in tool_schemas(request.tool_dicts() or []) if t.name in offered),
        calls_required=bool(tools) and (named or choice == "required"),
        single_call=named or request.parallel_tool_calls is False,
    )
    return ChatPrompt(
        text=text,
        opens_reasoning=opens_reasoning(text),
        dialect=fmt.dialect,
        calls=calls,
        max_tool_calls=1 if request.parallel_tool_calls is False else None,
    )


def _text_of(content: str | list[dict[str, str]] | None) -> str:
    """A message's text, its parts joined (as a template joins them)."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def _thinking(request: ChatPromptFields, default: bool) -> tuple[bool, str | None]:
    """(thinking, the encoder's reasoning effort) for a request; see the module docstring."""
    kwargs: dict[str, Any] = request.chat_template_kwargs or {}
    switches = {name: kwargs[name] for name in _SWITCHES if name in kwargs}
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise APIError(
                400,
                f"chat_template_kwargs.{name} must be true or false",
                param="chat_template_kwargs",
            )
    if len(set(switches.values())) > 1:
        raise APIError(
            400,
            "chat_template_kwargs.thinking and .enable_thinking disagree; send one of them",
            param="chat_template_kwargs",
        )
    explicit = next(iter(switches.values()), None)
    requested_effort = _requested_effort(request.reasoning_effort, kwargs.get(_EFFORT_KWARG))
    implied, effort = (None, None)
    if requested_effort is not None:
        implied, effort = EFFORTS[requested_effort]
    if explicit is not None and implied is not None and explicit != implied:
        raise APIError(
            400,
            f"reasoning_effort {requested_effort!r} turns thinking "
            f"{'on' if implied else 'off'}, but chat_template_kwargs turns it "
            f"{'on' if explicit else 'off'}",
            param="reasoning_effort",
        )
    asked = explicit if explicit is not None else implied
    thinking = default if asked is None else asked
    return thinking, effort if thinking else None


def _requested_effort(field: str | None, kwarg: object) -> str | None:
    """The reasoning effort asked for by the request's field or its chat_template_kwargs."""
    if kwarg is None:
        return field
    if not isinstance(kwarg, str) or kwarg not in EFFORTS:
        raise APIError(
            400,
            f"chat_template_kwargs.{_EFFORT_KWARG} must be one of {', '.join(EFFORTS)}; "
            f"got {kwarg!r}",
            param="chat_template_kwargs",
        )
    if field is not None and field != kwarg:
        raise APIError(
            400,
            f"reasoning_effort {field!r} and chat_template_kwargs.{_EFFORT_KWARG} {kwarg!r} "
            "disagree; send one of them",
            param="reasoning_effort",
        )
    return kwarg
