"""Anthropic's Messages API (`POST /v1/messages`, as vLLM and SGLang serve it) over the chat
path: the request becomes a chat completion request (system, text, `thinking`, `tool_use` and
`tool_result` blocks onto OpenAI messages; tools, tool choice, the thinking switch and
`output_config` — its `format` as a strict `json_schema` response format, its `effort` as the
reasoning effort in thinking mode — onto their chat fields), runs as one, and its parsed reply
is written as Anthropic's message: `thinking`, `text` and `tool_use` content blocks, or streamed
as its typed events (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`). A reply ended by one of `stop_sequences` says
`stop_reason: "stop_sequence"` and names it. `POST /v1/messages/count_tokens` counts the prompt
the same request would send.

A conversation that ends with an assistant message of text is an assistant prefill, as
Anthropic documents it: the reply continues that text (the chat path's vLLM
`continue_final_message`), and the answer holds only what follows it. As on Anthropic's API,
the prefill may not end in whitespace, and it is refused with thinking on (it would be read as
reasoning).

What the chat path cannot do is refused by name, as on the OpenAI routes: images and documents,
server tools. `thinking.budget_tokens` is accepted but not enforced apart: `max_tokens` bounds
the whole reply. Thinking blocks carry an empty `signature` (nothing here signs them); sent
back, they render as the turn's reasoning. Errors have Anthropic's shape (`{"type": "error",
"error": {type, message}}`).
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from dsaserve.services.router.api.body import LimitedRoute
from dsaserve.services.router.api.errors import APIError, error_responses, renamed_params
from dsaserve.services.router.api.schemas import (
    UINT32_MAX,
    ChatCompletionRequest,
    FunctionName,
    Text,
    _Body,
)
from dsaserve.services.router.api.streaming import EventStream, answer
from dsaserve.services.router.choices import ChatChoice
from dsaserve.services.router.generation import Launched, launch
from dsaserve.services.router.pd import Event, Finish
from dsaserve.services.router.state import router_state

JSON = dict[str, Any]
PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Chat finish reasons -> Anthropic's stop reasons.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Every error response's body on this route."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def error_body(error: APIError) -> JSON:
    """Anthropic's error body for an error of the router."""
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---------------------------------------------------------------- the request


class TextBlock(_Body):
    type: Literal["text"]
    text: Text
    cache_control: JSON | None = None  # prefix caching is automatic here
    citations: None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Text
    name: FunctionName
    input: JSON
    cache_control: JSON | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: StrictBool = False
    cache_control: JSON | None = None


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Discriminator("type")
]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class Tool(_Body):
    type: Literal["custom"] | None = None  # (server tools, web search and the like: refused)
    name: FunctionName
    description: Text | None = None
    input_schema: JSON
    cache_control: JSON | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=0)  # not enforced apart (module doc)


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: JSON = Field(alias="schema")


class OutputConfig(_Body):
    """Anthropic's structured outputs (`format`: the text is JSON of the schema, as strict as
    the chat route's `strict: true`) and `effort` (the reasoning's, in thinking mode)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesPrompt(_Body):
    """What makes a Messages request's prompt: what `count_tokens` counts."""

    model: Text | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def chat_body(self) -> JSON:
        """The chat completion request's fields that make the same prompt and reply format."""
        body: JSON = {"model": self.model, "messages": _chat_messages(self)}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        if (choice := self.tool_choice) is not None:
            body["tool_choice"] = {
                "auto": "auto",
                "any": "required",
                "none": "none",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        thinking = self.thinking is not None and self.thinking.type != "disabled"
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"thinking": thinking}
        if (config := self.output_config) is not None:
            if config.effort is not None and thinking:  # (without thinking it changes nothing)
                body["reasoning_effort"] = config.effort
            if config.format is not None:
                schema = {"name": "output", "schema": config.format.schema_, "strict": True}
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.messages[-1].role == "assistant":
            body["continue_final_message"] = _prefill(self.messages[-1], len(self.messages) - 1)
        return body

    def chat(self, **fields: Any) -> ChatCompletionRequest:
        """The same request as a chat completion, with these other chat `fields`."""
        try:
            return ChatCompletionRequest.model_validate({**self.chat_body(), **fields})
        except ValidationError as e:
            detail = e.errors()[0]
            where = ".".join(str(p) for p in detail["loc"])
            raise APIError(400, f"Invalid request ({where}): {detail['msg']}") from None


class MessagesRequest(MessagesPrompt):
    max_tokens: StrictInt = Field(ge=1, le=UINT32_MAX)
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    metadata: JSON | None = None  # (user_id: for the provider's abuse monitoring)

    def sampling_fields(self) -> JSON:
        """The chat request's sampling fields (not streamed: the route streams)."""
        fields: JSON = {"max_tokens": self.max_tokens, "stop": self.stop_sequences}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


class CountTokensRequest(MessagesPrompt):
    cache_control: JSON | None = None  # prefix caching is automatic here


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block.text for block in content)


def _prefill(message: InputMessage, index: int) -> bool:
    """Check a final assistant message as an assistant prefill: text, not ending in
    whitespace (Anthropic's rule)."""
    blocks = [message.content] if isinstance(message.content, str) else message.content
    texts = [b if isinstance(b, str) else b.text for b in blocks if isinstance(b, str | TextBlock)]
    where = f"messages[{index}].content"
    if len(texts) != len(blocks):
        raise APIError(
            400, "A final assistant message (a prefill) may hold only text blocks", param=where
        )
    if "".join(texts) != "".join(texts).rstrip():
        raise APIError(
            400, "final assistant content cannot end with trailing whitespace", param=where
        )
    return True


def _chat_messages(request: MessagesPrompt) -> list[JSON]:
    messages: list[JSON] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system)})
    for i, message in enumerate(request.messages):
        blocks = (
            [TextBlock(type="text", text=message.content)]
            if isinstance(message.content, str)
            else message.content
        )
        misplaced = next(
            (
                b.type
                for b in blocks
                if isinstance(b, ToolResultBlock if message.role == "assistant" else ThinkingBlock)
                or (message.role == "user" and isinstance(b, ToolUseBlock))
            ),
            None,
        )
        if misplaced is not None:
            raise APIError(
                400,
                f"messages[{i}]: a {message.role} message cannot hold a {misplaced} block",
                param=f"messages[{i}].content",
            )
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        if message.role == "user":
            # Tool results answer the assistant's calls, so they come first (OpenAI's order).
            for block in blocks:
                if isinstance(block, ToolResultBlock):
                    text = _text(block.content)
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text,
                        }
                    )
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
            continue
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        assistant: JSON = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            assistant["tool_calls"] = calls
        if any(isinstance(b, ThinkingBlock) for b in blocks):
            assistant["reasoning_content"] = reasoning
        messages.append(assistant)
    return messages


# ---------------------------------------------------------------- the reply


class MessageWriter:
    """The reply of one chat choice as Anthropic's message, whole or as stream events."""

    def __init__(self, run: Launched) -> None:
        choice = run.choices[0]
        assert isinstance(choice, ChatChoice)
        self._run, self._choice = run, choice
        self.id = "msg_" + run.request_id.partition("-")[2]
        self._block: tuple[int, str] | None = None  # the open block's (index, type)
        self._blocks = 0
        self._finish: Finish | None = None
        self._finish_reason: str | None = None

    # The whole message (feed every event, then build).

    def feed(self, index: int, event: Event) -> None:
        if isinstance(event, Finish):
            self._finish = event
            self._finish_reason = self._choice.finish(event)["finish_reason"]
        else:
            self._choice.chunk(event)

    def build(self) -> JSON:
        message = self._choice.answer()["message"]
        content: list[JSON] = []
        if message.get("reasoning_content"):
            content.append(
                {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
            )
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": _arguments(call["function"]["arguments"]),
                }
            )
        return {**self._head(), "content": content, **self._ending()}

    # The stream (StreamWriter).

    def opening(self) -> bytes:
        start = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {**self._usage(0), "output_tokens": 0}
        return _event("message_start", {"message": start})

    async def event(self, index: int, event: Event) -> bytes:
        if isinstance(event, Finish):
            self._finish = event
            delta = self._choice.finish(event)
            self._finish_reason = delta["finish_reason"]
            out = self._deltas(delta["delta"]) + self._close()
            ending = self._ending()
            stop = {k: ending[k] for k in ("stop_reason", "stop_sequence")}
            out += _event("message_delta", {"delta": stop, "usage": ending["usage"]})
            return out + _event("message_stop", {})
        chunk = self._choice.chunk(event)
        return b"" if chunk is None else self._deltas(chunk["delta"])

    def error(self, error: APIError) -> bytes:
        return _event("error", error_body(error))

    def closing(self) -> bytes:
        return b""

    def _deltas(self, delta: JSON) -> bytes:
        out = b""
        if text := delta.get("reasoning_content"):
            out += self._open("thinking", {"thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": text})
        if text := delta.get("content"):
            out += self._open("text", {"text": ""})
            out += self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call's first fragment names it
                block = {"id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._close() + self._open("tool_use", block)
            if fragment := call["function"].get("arguments"):
                out += self._delta({"type": "input_json_delta", "partial_json": fragment})
        return out

    def _open(self, kind: str, block: JSON) -> bytes:
        if self._block is not None and self._block[1] == kind and kind != "tool_use":
            return b""
        out = self._close()
        self._block = (self._blocks, kind)
        self._blocks += 1
        content = {"type": kind, **block}
        return out + _event(
            "content_block_start", {"index": self._block[0], "content_block": content}
        )

    def _delta(self, delta: JSON) -> bytes:
        assert self._block is not None
        return _event("content_block_delta", {"index": self._block[0], "delta": delta})

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        index, self._block = self._block[0], None
        return _event("content_block_stop", {"index": index})

    def _head(self) -> JSON:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self._run.model}

    def _usage(self, cached: int) -> JSON:
        return {
            "input_tokens": self._run.prompt_tokens - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def _ending(self) -> JSON:
        assert self._finish is not None and self._finish_reason is not None
        usage = {
            **self._usage(self._finish.cached_tokens),
            "output_tokens": self._finish.completion_tokens,
        }
        stop = _STOP_REASONS.get(self._finish_reason, "end_turn")
        sequence = self._finish.stop_reason
        if isinstance(sequence, str):  # one of the request's stop_sequences ended the text
            stop = "stop_sequence"
        else:
            sequence = None  # (EOS, or a stop token: the model's end of turn)
        return {"stop_reason": stop, "stop_sequence": sequence, "usage": usage}


def _arguments(arguments: str) -> JSON:
    """A call's arguments as the object Anthropic's `input` is ({} for a call cut short)."""
    with contextlib.suppress(json.JSONDecodeError):
        value = json.loads(arguments)
        if isinstance(value, dict):
            return value
    return {}


def _event(kind: str, data: JSON) -> bytes:
    text = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


# ---------------------------------------------------------------- the routes

# The chat request's fields by this API's names, in the errors they cause.
_PARAMS = {"response_format.json_schema.schema": "output_config.format.schema"}

router = APIRouter(
    route_class=LimitedRoute, responses=error_responses(401, body=AnthropicErrorBody)
)


@router.post(
    PATH,
    responses={
        200: {
            "description": "The message: one JSON object, or with `stream` its events (SSE)",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
        **error_responses(400, 401, 404, 413, 429, 503, 504, body=AnthropicErrorBody),
    },
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    chat = body.chat(**body.sampling_fields())
    with contextlib.ExitStack() as slots:
        with renamed_params(_PARAMS):
            run = await launch(request, chat, "msg", "messages", slots)
        writer = MessageWriter(run)
        if body.stream:
            return EventStream(run.events, writer, request.state, slots.pop_all().close)
        try:
            return await answer(run.events, writer.feed, writer.build, request)
        finally:
            await run.events.aclose()


@router.post(
    COUNT_TOKENS_PATH,
    responses=error_responses(400, 401, 404, 413, body=AnthropicErrorBody),
)
async def count_tokens(body: CountTokensRequest, request: Request) -> JSON:
    """The prompt tokens the same Messages request would send to prefill (its `usage`'s
    input_tokens and cache_read_input_tokens together)."""
    model = router_state(request).model
    model.check_name(body.model)
    with renamed_params(_PARAMS):
        _, ids = await model.chat_ids(body.chat())
    return {"input_tokens": len(ids)}
