"""A chat reply as the Responses API writes it: output items, whole or as typed stream events.

The items, in the order the model writes them: a `reasoning` item (its text as one
`reasoning_text` content part; no summary is generated), a `message` (one `output_text` part),
and a `function_call` per tool call (`call_id`: the chat's call id). The stream opens with
`response.created` and `response.in_progress`; each item is `response.output_item.added`, its
part's `response.content_part.added`, the deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`, the
part's and the item's `.done`; it ends with `response.completed`, or `response.incomplete`
when `max_output_tokens` cut the reply. Every event carries a `sequence_number`. A response to
store is stored before the event that completes it, so a client that continues from it at once
finds it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.api.responses.store import ResponseStore, StoredResponse
from dsaserve.services.router.choices import ChatChoice
from dsaserve.services.router.generation import Launched
from dsaserve.services.router.pd import Event, Finish

JSON = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    def __init__(
        self,
        run: Launched,
        request: JSON,
        conversation: list[JSON],
        store: ResponseStore | None,
        input_items: list[JSON],
        owner: str | None,
    ) -> None:
        """request: the request's fields (echoed in the response); conversation: the chat
        messages the response answers (without instructions), kept with it when `store`, with
        the request's `input_items`, as `owner`'s."""
        choice = run.choices[0]
        assert isinstance(choice, ChatChoice)
        self._run, self._choice, self._request = run, choice, request
        self._conversation, self._store = conversation, store
        self._input_items, self._owner = input_items, owner
        self.id = "resp_" + run.request_id.partition("-")[2]
        self._created = int(time.time())
        self._items: list[JSON] = []  # streamed so far
        self._open: JSON | None = None  # the item being streamed
        self._sequence = 0
        self.response: JSON | None = None  # once complete

    # ------------------------------------------------------------ whole

    def feed(self, index: int, event: Event) -> None:
        if isinstance(event, Finish):
            reason = self._choice.finish(event)["finish_reason"]
            self._finish(event, reason, self._whole_items())
        else:
            self._choice.chunk(event)

    def build(self) -> JSON:
        assert self.response is not None
        return self.response

    async def save(self) -> None:
        if self._store is not None and self.response is not None:
            message = self._choice.answer()["message"]
            reply = {k: v for k, v in message.items() if v is not None or k == "content"}
            stored = StoredResponse(
                self.response, [*self._conversation, reply], self._input_items, self._owner
            )
            await self._store.put(stored)

    def _whole_items(self) -> list[JSON]:
        message = self._choice.answer()["message"]
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
        if message["content"]:
            items.append(_message_item(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            items.append(_call_item(_id("fc"), call["id"], function["name"], function["arguments"]))
        return items

    def _finish(self, finish: Finish, reason: str, items: list[JSON]) -> None:
        cut = reason == "length"
        self.response = {
            **self._object("incomplete" if cut else "completed", items),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {
                "input_tokens": self._run.prompt_tokens,
                "input_tokens_details": {"cached_tokens": finish.cached_tokens},
                "output_tokens": finish.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self._choice.reasoning_tokens},
                "total_tokens": self._run.prompt_tokens + finish.completion_tokens,
            },
        }

    def _object(self, status: str, output: list[JSON]) -> JSON:
        r = self._request
        tools = [{k: v for k, v in t.items() if v is not None} for t in r.get("tools") or []]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "model": self._run.model,
            "output": output,
            "instructions": r.get("instructions"),
            "tools": tools,
            "tool_choice": r.get("tool_choice") or "auto",
            "parallel_tool_calls": r.get("parallel_tool_calls") is not False,
            "temperature": r.get("temperature"),
            "top_p": r.get("top_p"),
            "max_output_tokens": r.get("max_output_tokens"),
            "previous_response_id": r.get("previous_response_id"),
            "reasoning": {"effort": (r.get("reasoning") or {}).get("effort"), "summary": None},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": r.get("store", True),
            "metadata": r.get("metadata") or {},
            "user": r.get("user"),
            "incomplete_details": None,
            "error": None,
            "usage": None,
        }

    # ------------------------------------------------------------ streamed (StreamWriter)

    def opening(self) -> bytes:
        created = self._object("in_progress", [])
        return self._event("response.created", response=created) + self._event(
            "response.in_progress", response=created
        )

    async def event(self, index: int, event: Event) -> bytes:
        if not isinstance(event, Finish):
            chunk = self._choice.chunk(event)
            return b"" if chunk is None else self._deltas(chunk["delta"])
        end = self._choice.finish(event)
        out = self._deltas(end["delta"]) + self._close()
        self._finish(event, end["finish_reason"], self._items)
        await self.save()
        assert self.response is not None
        kind = (
            "response.incomplete" if self.response["incomplete_details"] else "response.completed"
        )
        return out + self._event(kind, response=self.response)

    def error(self, error: APIError) -> bytes:
        body = error.body()["error"]
        return self._event("error", code=body["code"], message=body["message"], param=body["param"])

    def closing(self) -> bytes:
        return b""

    def _deltas(self, delta: JSON) -> bytes:
        out = b""
        if text := delta.get("reasoning_content"):
            out += self._start("reasoning", lambda: _reasoning_item(_id("rs"), "", "in_progress"))
            out += self._text_delta("response.reasoning_text.delta", text)
        if text := delta.get("content"):
            out += self._start("message", lambda: _message_item(_id("msg"), "", "in_progress"))
            out += self._text_delta("response.output_text.delta", text)
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call's first fragment names it
                name = call["function"]["name"]
                out += self._close()
                out += self._start(
                    "function_call",
                    lambda c=call, n=name: _call_item(_id("fc"), c["id"], n, "", "in_progress"),
                )
            if fragment := call["function"].get("arguments"):
                assert self._open is not None
                self._open["arguments"] += fragment
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=len(self._items) - 1,
                    delta=fragment,
                )
        return out

    def _start(self, kind: str, make: Any) -> bytes:
        if self._open is not None and self._open["type"] == kind and kind != "function_call":
            return b""
        out = self._close()
        item = make()
        self._open = item
        self._items.append(item)
        at = {"output_index": len(self._items) - 1}
        out += self._event("response.output_item.added", **at, item=_copy(item))
        if kind != "function_call":
            part = _copy(item["content"][0])
            out += self._event(
                "response.content_part.added", **at, item_id=item["id"], content_index=0, part=part
            )
        return out

    def _text_delta(self, kind: str, text: str) -> bytes:
        assert self._open is not None
        self._open["content"][0]["text"] += text
        extra: JSON = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self._event(
            kind,
            item_id=self._open["id"],
            output_index=len(self._items) - 1,
            content_index=0,
            delta=text,
            **extra,
        )

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": len(self._items) - 1}
        out = b""
        if item["type"] == "function_call":
            out += self._event(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra: JSON = {"logprobs": []} if kind == "output_text" else {}
            out += self._event(
                f"response.{kind}.done", **at, content_index=0, text=part["text"], **extra
            )
            out += self._event(
                "response.content_part.done", **at, content_index=0, part=_copy(part)
            )
        return out + self._event(
            "response.output_item.done", output_index=at["output_index"], item=_copy(item)
        )

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {text}\n\n".encode()


def _copy(value: JSON) -> JSON:
    return json.loads(json.dumps(value))


def _reasoning_item(item_id: str, text: str, status: str) -> JSON:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(item_id: str, text: str, status: str) -> JSON:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> JSON:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
