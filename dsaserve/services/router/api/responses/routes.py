"""OpenAI's Responses API over the chat path: `POST /v1/responses`; of a stored response
`GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and `DELETE /v1/responses/{id}`
(each only for the API key that made it: another gets 404).

`input` (a text, or items: messages, `function_call`s, their `function_call_output`s and
`reasoning` items, as the API returns them) becomes chat messages after `instructions` and, with
`previous_response_id`, after the stored conversation of that response (store.py);
function tools, tool choice, `reasoning.effort` and `max_output_tokens` become their chat
fields. The reply is written as output items: a `reasoning` item (V4's thinking, as
`reasoning_text` content), a `message` with `output_text`, one `function_call` per call, whole
or streamed as the API's typed events (output.py). With `store` (the default) the
response and its conversation are kept in Redis for `--response-ttl` seconds; `store: false`
keeps nothing.

`text.format` (`json_schema`, strict or not, and `json_object`) constrains the reply as the chat
route's `response_format` does, after the reasoning in thinking mode.

What the chat path cannot do is refused by name: other tools than functions, images and files,
`truncation: "auto"`, background runs, conversations and stored prompts.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
)

from dsaserve.services.router.api import fields
from dsaserve.services.router.api.body import LimitedRoute
from dsaserve.services.router.api.errors import APIError, error_responses, renamed_params
from dsaserve.services.router.api.responses.output import ResponseWriter
from dsaserve.services.router.api.schemas import (
    UINT32_MAX,
    ChatCompletionRequest,
    FunctionName,
    ReasoningEffort,
    Text,
    _Body,
)
from dsaserve.services.router.api.streaming import EventStream, answer
from dsaserve.services.router.generation import launch
from dsaserve.services.router.state import router_state

JSON = dict[str, Any]


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextPart]
    id: Text | None = None
    status: Text | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: FunctionName
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[TextPart]
    id: Text | None = None
    status: Text | None = None


class ReasoningPart(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None  # (never written here)
    status: Text | None = None


def _item_kind(item: object) -> str:
    return str(item.get("type") or "message") if isinstance(item, dict) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JSON | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: FunctionName


class Reasoning(_Body):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # (the whole text is given)
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class PlainFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    """Structured outputs (the chat route's `json_schema`, flattened as this API writes it)."""

    type: Literal["json_schema"]
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: JSON = Field(alias="schema")
    description: Text | None = None
    strict: StrictBool | None = None


class TextOptions(_Body):
    format: (
        Annotated[PlainFormat | JsonObjectFormat | JsonSchemaFormat, Discriminator("type")] | None
    ) = None
    verbosity: Literal["medium"] | None = None

    def response_format(self) -> JSON | None:
        """The chat route's `response_format` of this format (None: free text)."""
        if isinstance(self.format, JsonObjectFormat):
            return {"type": "json_object"}
        if isinstance(self.format, JsonSchemaFormat):
            spec = self.format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            return {"type": "json_schema", "json_schema": spec}
        return None


class ResponsesRequest(_Body):
    no_op_fields = fields.RESPONSES

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: Text | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    # vLLM's (as on chat): in thinking mode, the most tokens the reasoning may take
    thinking_token_budget: StrictInt | None = Field(default=None, ge=1, le=UINT32_MAX)
    metadata: dict[str, Text] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None  # (nothing to add)
    truncation: Literal["disabled"] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None  # (for the provider's abuse monitoring: unused)
    prompt_cache_key: Text | None = None  # (prefix caching is automatic here)

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, tools: object) -> object:
        # Before validation, so a built-in tool is named as such, not as a malformed function.
        for tool in tools if isinstance(tools, list) else []:
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(
                    f"only function tools are supported, got type {tool.get('type')!r}"
                )
        return tools

    def chat(self, history: list[JSON]) -> tuple[ChatCompletionRequest, list[JSON]]:
        """(The chat completion request, the conversation without instructions: `history`
        and then this input's messages)."""
        conversation = history + _messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: JSON = {"model": self.model, "messages": system + conversation}
        optional = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "thinking_token_budget": self.thinking_token_budget,
        }
        body |= {k: v for k, v in optional.items() if v is not None}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if self.text is not None and (response_format := self.text.response_format()):
            body["response_format"] = response_format
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate(body), conversation
        except ValidationError as e:
            detail = e.errors()[0]
            where = ".".join(str(p) for p in detail["loc"])
            raise APIError(400, f"Invalid request ({where}): {detail['msg']}") from None


_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _input_items(items: str | list[Any]) -> list[JSON]:
    """The request's input as the API lists it back (`input_items`): items with their type,
    an id (theirs, or a new one), a status and content parts."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        kind = data.setdefault("type", "message")
        data.setdefault("id", f"{_ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}")
        data.setdefault("status", "completed")
        if kind == "message" and isinstance(data["content"], str):
            part = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": part, "text": data["content"]}]
        out.append(data)
    return out


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _messages(items: str | list[Any]) -> list[JSON]:
    """Input items as chat messages: an assistant's reasoning, text and calls, which the API
    lists as separate items, make one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[JSON] = []
    assistant: JSON | None = None  # the assistant message being gathered
    for item in items:
        if (
            isinstance(item, MessageItem)
            and item.role != "assistant"
            or isinstance(item, FunctionCallOutputItem)
        ):
            assistant = None
            if isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                )
            else:
                messages.append({"role": item.role, "content": _text(item.content)})
            continue
        if assistant is None:
            assistant = {"role": "assistant", "content": None}
            messages.append(assistant)
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content is not None else item.summary
            assistant["reasoning_content"] = "".join(p.text for p in parts)
        elif isinstance(item, MessageItem):
            assistant["content"] = (assistant["content"] or "") + _text(item.content)
        else:
            call = {"name": item.name, "arguments": item.arguments}
            assistant.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    return messages


# The chat request's fields by this API's names, in the errors they cause.
_PARAMS = {
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}

router = APIRouter(route_class=LimitedRoute, responses=error_responses(401))
_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response: one JSON object, or with `stream` its events (SSE)",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
}


@router.post(
    "/v1/responses", responses={**_RESPONSE, **error_responses(400, 401, 404, 413, 429, 503, 504)}
)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    store, owner = router_state(request).responses, request.state.tenant
    history: list[JSON] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id, owner, "previous_response_id")
        history = previous.messages
    chat, conversation = body.chat(history)
    with contextlib.ExitStack() as slots:
        with renamed_params(_PARAMS):
            run = await launch(request, chat, "resp", "input", slots)
        echoed = body.model_dump(exclude={"input"})
        writer = ResponseWriter(
            run,
            echoed,
            conversation,
            store if body.store else None,
            _input_items(body.input),
            owner,
        )
        if body.stream:
            return EventStream(run.events, writer, request.state, slots.pop_all().close)
        try:
            response = await answer(run.events, writer.feed, writer.build, request)
        finally:
            await run.events.aclose()
        await writer.save()
        return response


@router.get("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
async def get_response(response_id: str, request: Request) -> JSON:
    """A stored response (store: true), while its TTL lasts."""
    stored = await router_state(request).responses.get(response_id, request.state.tenant)
    return stored.response


@router.get(
    "/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404, 503)
)
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    before: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,  # (nothing to add to these items)
) -> JSON:
    """The input items of a stored response's request, a page at a time (OpenAI's cursor
    list: `after`/`before` an item id, `limit`, `order` "desc" by default)."""
    stored = await router_state(request).responses.get(response_id, request.state.tenant)
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"No input item with id '{cursor}' in this response.", param=name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    page = items[start:end][:limit] if before is None else items[start:end][-limit:]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": (start + len(page) < end) if before is None else (end - len(page) > start),
    }


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
async def delete_response(response_id: str, request: Request) -> JSON:
    """Delete a stored response: it can no longer be read or continued."""
    await router_state(request).responses.delete(response_id, request.state.tenant)
    return {"id": response_id, "object": "response", "deleted": True}
