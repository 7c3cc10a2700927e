"""DeepSeek's DSML tool calls, written into prompts (`tool_calls_block`) and read back with the
rest of a completion into OpenAI fields (reasoning, content, tool calls), whole or streamed.

What the model writes after a V4 prompt (see encoding_dsv4), and how the release's
`parse_message_from_completion_text` reads it:

    [reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    ...
    </｜DSML｜invoke>
    ...
    </｜DSML｜tool_calls>]<｜end▁of▁sentence｜>

DeepSeek-V3.2 writes the same grammar with `function_calls` for the block's name (its release's
`encoding_dsv32.py`); a `Dialect` names the block, and everything here takes one (V4's by
default). The reasoning part exists in thinking mode only (the prompt already ends with
`<think>`). The blank line before the block belongs to neither content nor calls. A call's
`arguments` are the JSON text `{"KEY": VALUE, ...}` with the release's separators: a
string="true" value becomes a JSON string, a string="false" value is inserted as the JSON it
already is.

The release raises on anything else; a server cannot, so `StreamParser` reads the same grammar
but recovers, and says so instead of raising:

- a tool block that starts before `</think>` ends the reasoning: models do skip `</think>`
  before a call, and losing the call that way was a known vLLM bug;
- output that ends inside the reasoning or inside a tool block sets `reasoning_open` or
  `tool_block_open`; calls whose `</｜DSML｜invoke>` never came are kept, marked incomplete;
- markup that breaks the grammar (junk between tags, a missing attribute, a string="false" value
  that is not JSON -- sent as a JSON string instead, so arguments always parse) sets `malformed`;
- stray `<think>`/`</think>` are dropped, and text after a tool block is content again.

Markup never reaches reasoning or content: text that could still become a marker is held back
until it is decided, and a marker cut off by the end of the output is dropped.
`parse_completion` is the same parser run over a whole text, so a stream's events always add up
to exactly the non-streamed result.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from dsaserve.engine.text.chat.tokens import (
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
)


@dataclass(frozen=True)
class Dialect:
    """The name of a family's tool-call block: `<｜DSML｜{block}>` ... `</｜DSML｜{block}>`."""

    block: str

    @property
    def open(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def close(self) -> str:
        return f"</{DSML}{self.block}>"


V4_DSML = Dialect("tool_calls")
V32_DSML = Dialect("function_calls")


def tool_calls_block(calls: Sequence[tuple[str, Mapping[str, Any]]], dialect: Dialect) -> str:
    """The block an assistant turn's calls (name, arguments) are written as, blank line first, as
    the releases' encoders write it: string values as they are with string="true", anything
    else as JSON (non-ASCII kept) with string="false"; "" for no calls."""
    if not calls:
        return ""
    invokes = []
    for name, arguments in calls:
        parameters = []
        for key, value in arguments.items():
            is_string = isinstance(value, str)
            text = value if is_string else json.dumps(value, ensure_ascii=False)
            flag = "true" if is_string else "false"
            parameters.append(
                f'{PARAMETER_OPEN} name="{key}" string="{flag}">{text}{PARAMETER_CLOSE}'
            )
        invokes.append(
            f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(parameters) + f"\n{INVOKE_CLOSE}"
        )
    return f"\n\n{dialect.open}\n" + "\n".join(invokes) + f"\n{dialect.close}"


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new call: OpenAI's first `delta.tool_calls` entry for `index` carries id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """The next piece of call `index`'s `function.arguments` (pieces concatenate to its JSON)."""

    index: int
    fragment: str


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object; partial if not `complete`
    complete: bool  # its </｜DSML｜invoke> (or the end of its block) was seen


@dataclass(frozen=True)
class ParsedMessage:
    reasoning_content: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    reasoning_open: bool  # the output ended inside the reasoning (no </think>, no tool block)
    tool_block_open: bool  # the output ended inside a tool-call block
    malformed: bool  # markup broke the grammar and was repaired or dropped

    @property
    def complete(self) -> bool:
        """The output ended where the format lets it end (after content or a closed block)."""
        return not (self.reasoning_open or self.tool_block_open)


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_completion(
    text: str,
    thinking: bool,
    *,
    dialect: Dialect | None = V4_DSML,
    new_id: Callable[[], str] = new_tool_call_id,
) -> ParsedMessage:
    """The whole output of one generation (EOS text optional) as one assistant message."""
    parser = StreamParser(thinking, dialect=dialect, new_id=new_id)
    parser.feed(text)
    parser.finish()
    return parser.message()


class _State(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    AFTER_BLOCK = enum.auto()  # content again, leading whitespace dropped
    BLOCK = enum.auto()  # inside <｜DSML｜tool_calls>, between invokes
    INVOKE_HEAD = enum.auto()  # reading ' name="...">'
    INVOKE_BODY = enum.auto()  # between parameters
    PARAM_HEAD = enum.auto()  # reading ' name="..." string="...">'
    PARAM_VALUE = enum.auto()
    DONE = enum.auto()  # after EOS: nothing more is read


# Markers each state watches for. The one that starts first in the text wins.
_TOOL_START = f"<{DSML}"


@cache
def _markers(dialect: Dialect | None) -> dict[_State, tuple[str, ...]]:
    if dialect is None:  # no tools offered: markup is text, only think tags and EOS count
        plain = (THINK_END, THINK_START, EOS)
        return {state: plain if state in _TEXT_STATES else () for state in _State}
    opening, closing = dialect.open, dialect.close
    markers = {
        _State.REASONING: (THINK_END, "\n\n" + opening, opening, THINK_START, EOS),
        _State.CONTENT: ("\n\n" + _TOOL_START, _TOOL_START, THINK_END, THINK_START, EOS),
        _State.BLOCK: (opening, INVOKE_OPEN, closing, EOS),
        _State.INVOKE_HEAD: (">", "<"),
        _State.INVOKE_BODY: (PARAMETER_OPEN, INVOKE_CLOSE, INVOKE_OPEN, closing, EOS),
        _State.PARAM_HEAD: (">", "<"),
        _State.PARAM_VALUE: (PARAMETER_CLOSE, PARAMETER_OPEN, INVOKE_CLOSE, closing, EOS),
        _State.DONE: (),
    }
    markers[_State.AFTER_BLOCK] = markers[_State.CONTENT]
    return markers


@cache
def _marker_starts(dialect: Dialect | None) -> dict[_State, re.Pattern[str]]:
    """Per state, a pattern for any character its markers start with: a buffer it does not
    match holds neither a marker nor a marker's beginning (most streamed tokens)."""
    return {
        state: re.compile("[" + re.escape("".join({m[0] for m in markers})) + "]")
        if markers
        else re.compile("(?!)")
        for state, markers in _markers(dialect).items()
    }


_TEXT_STATES = frozenset({_State.REASONING, _State.CONTENT, _State.AFTER_BLOCK})
_BLOCK_STATES = frozenset(
    {_State.BLOCK, _State.INVOKE_HEAD, _State.INVOKE_BODY, _State.PARAM_HEAD, _State.PARAM_VALUE}
)
_NAME = re.compile(r'\bname="([^"]*)"')
_STRING = re.compile(r'\bstring="(true|false)"')


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    params: int = 0
    complete: bool = False


class StreamParser:
    """Incremental parser: feed it the detokenizer's text deltas, get OpenAI-shaped events.

    Deltas may split anything anywhere, markers included; the events are the same however the
    text is split. Call `finish()` once at the end of the output, then `message()` for the
    whole result and its flags.
    """

    def __init__(
        self,
        thinking: bool,
        *,
        dialect: Dialect | None = V4_DSML,
        new_id: Callable[[], str] = new_tool_call_id,
    ) -> None:
        """dialect: how tool calls are written; None where no tools were offered (the reply
        has no calls to read, and DSML markup in it stays text)."""
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._dialect, self._markers = dialect, _markers(dialect)
        self._starts = _marker_starts(dialect)
        self._new_id = new_id
        self._buf = ""  # text not yet consumed: at most a possible marker's beginning
        self._head = ""  # an invoke or parameter tag's attributes, until its ">"
        self._events: list[Event] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._call: _Call | None = None  # the call being written, if its header was valid
        self._param_kind: str | None = None  # "string" or "json"; None: dropped parameter
        self._json_value: list[str] = []
        self._malformed = False
        self._end_state: _State | None = None  # where the output ended (at EOS or finish)
        self._cut_block = False  # the output ended in the middle of a tool block's first tag
        self._finished = False

    @property
    def reasoning(self) -> bool:
        """Whether the text read so far is still inside the reasoning."""
        return self._state is _State.REASONING

    def feed(self, delta: str) -> list[Event]:
        """Events for the text so far, minus any tail that could still be a marker."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        while self._step():
            pass
        return self._take_events()

    def finish(self) -> list[Event]:
        """Flush what was held back; an unfinished marker at the very end is dropped."""
        if not self._finished:
            self._finished = True
            held, self._buf = self._buf, ""
            if not _is_cut_marker(held):
                self._text(held)
            elif held.lstrip("\n").startswith(_TOOL_START[:3]):
                self._cut_block = True  # "<｜D...": a tool block was starting
            self._stop()
        return self._take_events()

    def message(self) -> ParsedMessage:
        """Everything parsed so far; after `finish()`, the whole assistant message."""
        end = self._end_state or self._state
        return ParsedMessage(
            reasoning_content="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=tuple(
                ToolCall(c.id, c.name, "".join(c.arguments), c.complete) for c in self._calls
            ),
            reasoning_open=end is _State.REASONING,
            tool_block_open=end in _BLOCK_STATES or self._cut_block,
            malformed=self._malformed,
        )

    # -- scanning
    def _step(self) -> bool:
        """Consume up to and including the first marker; False once only a held tail is left."""
        if self._starts[self._state].search(self._buf) is None:
            self._text(self._buf)
            self._buf = ""
            return False
        markers = self._markers[self._state]
        found = _first_marker(self._buf, markers)
        if found is None:
            keep = _held_length(self._buf, markers)
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            self._text(text)
            return False
        start, marker = found
        self._text(self._buf[:start])
        self._buf = self._buf[start + len(marker) :]
        self._on_marker(marker)
        return True

    def _text(self, text: str) -> None:
        """Text between markers, in the current state."""
        if not text:
            return
        state = self._state
        if state is _State.AFTER_BLOCK:
            text = text.lstrip()
            if not text:
                return
            self._malformed = True  # the release allows nothing after the block
            self._state = state = _State.CONTENT
        if state is _State.REASONING:
            self._reasoning.append(text)
            self._events.append(ReasoningDelta(text))
        elif state is _State.CONTENT:
            self._content.append(text)
            self._events.append(ContentDelta(text))
        elif state in (_State.INVOKE_HEAD, _State.PARAM_HEAD):
            self._head += text
        elif state is _State.PARAM_VALUE:
            if self._param_kind == "string":
                self._args(json.dumps(text, ensure_ascii=False)[1:-1])
            elif self._param_kind == "json":
                self._json_value.append(text)
        elif state in (_State.BLOCK, _State.INVOKE_BODY) and not text.isspace():
            self._malformed = True  # dropped: nothing but whitespace belongs between tags

    def _on_marker(self, marker: str) -> None:
        state = self._state
        if marker == EOS:
            self._stop()
        elif marker in (THINK_START, THINK_END):
            if state is _State.REASONING and marker == THINK_END:
                self._state = _State.CONTENT
            # Otherwise a stray think tag: dropped.
        elif state is _State.REASONING:  # a tool block before </think>
            self._state = _State.BLOCK
        elif state in (_State.CONTENT, _State.AFTER_BLOCK):  # "<｜DSML｜", maybe after "\n\n"
            self._buf = _TOOL_START + self._buf  # the block reads the tag itself
            self._state = _State.BLOCK
        elif state in (_State.INVOKE_HEAD, _State.PARAM_HEAD):
            if marker == "<":
                self._buf = marker + self._buf
                self._malformed = True  # a tag without its ">"
            head, self._head = self._head, ""
            if state is _State.INVOKE_HEAD:
                self._start_call(head)
            else:
                self._start_param(head)
        elif self._dialect is not None and marker == self._dialect.open:
            pass  # the block's opening tag (or a repeated one): nothing to do
        elif marker == INVOKE_OPEN:
            if state is not _State.BLOCK:
                self._malformed = True  # the previous invoke was never closed
            self._end_call()
            self._state = _State.INVOKE_HEAD
        elif marker == PARAMETER_OPEN:
            if state is _State.PARAM_VALUE:
                self._malformed = True  # the previous parameter was never closed
            self._close_param()
            self._state = _State.PARAM_HEAD
        elif marker == PARAMETER_CLOSE:
            self._close_param()
            self._state = _State.INVOKE_BODY
        elif marker == INVOKE_CLOSE:
            if state is _State.PARAM_VALUE:
                self._malformed = True
            self._end_call()
            self._state = _State.BLOCK
        elif self._dialect is not None and marker == self._dialect.close:
            if state is not _State.BLOCK:
                self._malformed = True
            self._end_call()
            self._state = _State.AFTER_BLOCK

    def _stop(self) -> None:
        """The output ends here (EOS or its end): nothing after this is read."""
        if self._state is _State.DONE:
            return
        if self._state is _State.PARAM_VALUE and self._param_kind == "json":
            self._args("".join(self._json_value))  # verbatim: the call is incomplete anyway
        self._end_state, self._state = self._state, _State.DONE

    # -- tool calls
    def _start_call(self, head: str) -> None:
        self._state = _State.INVOKE_BODY
        name = _NAME.search(head)
        if name is None:
            self._malformed = True  # no name: the invoke is read but dropped
            self._call = None
            return
        self._call = _Call(len(self._calls), self._new_id(), name.group(1))
        self._calls.append(self._call)
        self._events.append(ToolCallStart(self._call.index, self._call.id, self._call.name))

    def _start_param(self, head: str) -> None:
        self._state = _State.PARAM_VALUE
        name, string = _NAME.search(head), _STRING.search(head)
        if self._call is None or name is None:
            self._malformed = self._malformed or name is None
            self._param_kind = None
            return
        if string is None:
            self._malformed = True  # kept as JSON if it parses, else as a string
        # A JSON value is held until its close tag: one that does not parse is sent as a string.
        self._param_kind = "string" if string and string.group(1) == "true" else "json"
        self._json_value = []
        key = json.dumps(name.group(1), ensure_ascii=False)
        opening = '"' if self._param_kind == "string" else ""
        self._args(("{" if self._call.params == 0 else ", ") + f"{key}: {opening}")
        self._call.params += 1

    def _close_param(self) -> None:
        if self._state is not _State.PARAM_VALUE:
            return
        if self._param_kind == "string":
            self._args('"')
        elif self._param_kind == "json":
            value = "".join(self._json_value)
            try:
                json.loads(value)
            except ValueError:
                self._malformed = True
                value = json.dumps(value, ensure_ascii=False)
            self._args(value)
        self._param_kind = None
        self._state = _State.INVOKE_BODY

    def _end_call(self) -> None:
        self._close_param()
        call, self._call = self._call, None
        if call is not None:
            self._args("}" if call.params else "{}", call)
            call.complete = True

    def _args(self, fragment: str, call: _Call | None = None) -> None:
        call = call or self._call
        if call is None or not fragment:
            return
        call.arguments.append(fragment)
        self._events.append(ToolCallArguments(call.index, fragment))

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The marker that starts first in `text` (the longest, if two start together)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best


def _held_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that some marker starts with."""
    longest = 0
    for marker in markers:
        # A held tail starts with the marker's first character: only its places in the last
        # len(marker) - 1 characters are tried, leftmost (longest) first, and only for tails
        # longer than one already found. This runs once per streamed token, where trying every
        # length was most of the parser's time.
        end = len(text) - longest
        at = text.find(marker[0], max(0, len(text) - len(marker) + 1), end)
        while at >= 0:
            if marker.startswith(text[at:]):
                longest = len(text) - at
                break
            at = text.find(marker[0], at + 1, end)
    return longest


def _is_cut_marker(held: str) -> bool:
    """Whether a tail held back at the end of the output is markup rather than text.

    Only a marker's beginning is ever held. A lone "<" or newlines are likely text; "<｜" opens
    only special markers, and three characters of a think tag are taken as one.
    """
    rest = held.lstrip("\n")
    if rest.startswith(("<｜", "</｜")):
        return True
    return len(rest) >= 3 and (THINK_START.startswith(rest) or THINK_END.startswith(rest))
