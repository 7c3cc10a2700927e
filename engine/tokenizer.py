"""Tokenizer, chat template and streaming detokenizer of a checkpoint, without torch.

The router renders chat templates and counts prompt tokens before any GPU work, and it must start
without torch; so this module depends only on `tokenizers` and `jinja2`. It reads the files a
Hugging Face checkpoint ships and renders templates the way transformers' `apply_chat_template`
does, so a prompt tokenizes here exactly as it would there.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, processors

from engine import token_bound

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REPLACEMENT = "\ufffd"  # what decoding puts in place of an incomplete or invalid UTF-8 sequence
_SURROGATE = re.compile("[\ud800-\udfff]")


class ChatTemplateError(ValueError):
    """Chat messages the template cannot take, or a chat template that failed to render."""


class Tokenizer:
    """A checkpoint's tokenizer: text <-> token ids, and chat messages -> prompt."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._template = None if chat_template is None else _compile_template(chat_template)
        self._template_variables = (
            frozenset()
            if chat_template is None
            else frozenset(jinja2.meta.find_undeclared_variables(_JINJA.parse(chat_template)))
        )
        # What a template sees besides the messages, as transformers passes it.
        self._template_tokens = {
            name: token
            for name, token in (("bos_token", bos_token), ("eos_token", eos_token))
            if token is not None
        }
        self._bos_token_id = None if bos_token is None else _token_id(backend, bos_token)
        eos_ids = [] if eos_token is None else [_token_id(backend, eos_token)]
        self._eos_token_ids = frozenset((*eos_ids, *extra_eos_token_ids))
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._added_bytes = {i: token.content.encode() for i, token in added.items()}
        # A byte-level vocabulary spells each byte as one character (GPT-2's alphabet).
        self._byte_of = (
            {c: b for b, c in enumerate(byte_level_alphabet())}
            if isinstance(backend.decoder, decoders.ByteLevel)
            else None
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Load from a checkpoint directory holding tokenizer.json and its companion files."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        # Like transformers 5: the post-processor in tokenizer.json decides what
        # `add_special_tokens` adds; add_bos_token/add_eos_token only apply where it has none.
        if backend.post_processor is None:
            add_bos = bos_token if config.get("add_bos_token") else None
            add_eos = eos_token if config.get("add_eos_token") else None
            backend.post_processor = _bos_eos_processor(backend, add_bos, add_eos)
        # Generation stops at any eos the model's configs name (DeepSeek lists it in both).
        extra_eos_ids = [
            *_as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_as_ids(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        return cls(
            backend,
            chat_template=_read_chat_template(model_dir, config),
            bos_token=bos_token,
            eos_token=eos_token,
            extra_eos_token_ids=extra_eos_ids,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id (base vocabulary plus added tokens)."""
        return self._vocab_size

    def max_chars_per_token(self) -> int | None:
        """The most text characters one token covers, or None if unknown (`engine.token_bound`):
        a text of n characters encodes to at least ceil(n / this) tokens. Reads the whole
        vocabulary: call it once."""
        return token_bound.max_chars_per_token(json.loads(self._backend.to_str()))

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special tokens: the ones `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in it map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if (surrogate := _SURROGATE.search(text)) is not None:
            # JSON escapes can smuggle half a UTF-16 pair into a str; it has no UTF-8 bytes.
            raise ValueError(
                f"text is not valid Unicode: lone surrogate {surrogate.group()!r} "
                f"at index {surrogate.start()}"
            )
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 become U+FFFD."""
        bad = next((i for i in token_ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            # The backend would silently drop it, hiding a sampler or model-size bug.
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to a text (OpenAI's logprobs `bytes`): exact even when a
        token holds part of a UTF-8 character, which decoding it alone cannot show."""
        if token_id in self._added_bytes:
            return self._added_bytes[token_id]
        if self._byte_of is not None:
            return bytes(self._byte_of[c] for c in self._backend.id_to_token(token_id))
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (empty without a template)."""
        return self._template_variables

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` into the prompt text the model was trained on.

        `tools` are OpenAI tool definitions; `variables` are more template variables (a
        request's `chat_template_kwargs`), as transformers passes them. Raises
        ChatTemplateError if the messages are malformed, the tokenizer has no chat template, or
        the template fails (including its own `raise_exception`).
        """
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        plain_messages = _validate_messages(messages)
        variables = variables or {}
        reserved = sorted(_RESERVED_VARIABLES & variables.keys())
        if reserved:
            raise ChatTemplateError(f"template variables may not be named {', '.join(reserved)}")
        try:
            # transformers always passes tools and documents; templates test `tools is none`.
            return self._template.render(
                **self._template_tokens,
                **variables,
                messages=plain_messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e.message}") from e
        # The template is code from the checkpoint: whatever it raises is a template failure,
        # which the caller reports as a bad request rather than crashing on.
        except Exception as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt token ids for `messages`: the rendered template, special tokens included."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template writes bos itself; adding special tokens would put a second one in front.
        return self.encode(prompt, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never cutting a UTF-8 character in half.

    Concatenating the pushed pieces and `flush()` gives `tokenizer.decode(token_ids)`. Each push
    decodes only a short window of recent tokens (vLLM's prefix/read offsets): text is emitted
    relative to tokens already emitted, so decoders that treat the first token specially (a
    stripped leading space) still give the same text as one decode of the whole stream.
    """

    # A character is at most 4 UTF-8 bytes, so an unfinished one has at most 3, in at most 3
    # tokens (assuming each token carries a byte). Anything older can be emitted.
    _MAX_PARTIAL_TOKENS = 3

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: context, already emitted
        self._read_offset = 0  # tokens before this are emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        end = len(self._ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, end)
        if not window.endswith(_REPLACEMENT):
            # Shorter or equal text means the new tokens added nothing yet (e.g. a skipped
            # special token); waiting keeps the window's first token the same for decoders
            # that strip a leading space from it.
            if len(window) <= len(prefix_text):
                return ""
            return self._emit(window[len(prefix_text) :], end)
        # The window ends in U+FFFD: perhaps half a character. Hold the last tokens back but
        # emit older ones once their text is settled, so a long run of invalid bytes cannot
        # grow the window (and the cost of a push) without bound.
        split = end - self._MAX_PARTIAL_TOKENS
        if split > self._read_offset:
            head = self._decode(self._prefix_offset, split)
            # Equal means no character straddles `split`, so later tokens cannot change `head`.
            if head + self._decode(split, end) == window:
                return self._emit(head[len(prefix_text) :], split)
        return ""

    def held(self) -> str:
        """The text of the tokens held back, as `flush` would emit it now (nothing is emitted)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        return window[len(prefix_text) :]

    def flush(self) -> str:
        """Emit whatever is held back, an unfinished character as U+FFFD (at end of stream)."""
        return self._emit(self.held(), len(self._ids))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _emit(self, piece: str, read_offset: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._pieces.append(piece)
        return piece


def byte_level_alphabet() -> list[str]:
    """ByteLevel's stand-in character for each byte, indexed by byte value (GPT-2's map)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), 256))
    unprintable = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(unprintable)}
    return [chars[b] for b in range(256)]


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(message)`."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's tojson, which HTML-escapes and takes no options; templates
    # render tools and arguments with it, so ours must print the same.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Templates come with checkpoints and are untrusted: the sandbox refuses `_` attributes and
    # unsafe calls, and "immutable" also refuses mutating the lists and dicts passed in.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_JINJA = _make_environment()


def _compile_template(source: str) -> jinja2.Template:
    try:
        return _JINJA.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template line {e.lineno}: {e.message}") from e


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; return copies with text content flattened to one string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    return [_validate_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _validate_message(where: str, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(
            f"{where} must be an object with 'role' and 'content', got {type(message).__name__}"
        )
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        roles = ", ".join(CHAT_ROLES)
        raise ChatTemplateError(f"{where}.role must be one of {roles}; got {role!r}")
    if "content" not in message:
        raise ChatTemplateError(f"{where} has no 'content'")
    # Like transformers, drop null fields (OpenAI clients send `"tool_calls": null`):
    # templates handle a missing key, but print "None" or fail on a null one.
    fields = {key: value for key, value in message.items() if value is not None}
    content = message["content"]
    if content is None and role == "assistant":
        content = ""  # a turn of tool calls only
    if "tool_calls" in fields:
        fields["tool_calls"] = [_template_tool_call(call) for call in fields["tool_calls"]]
    return {**fields, "content": _text_content(f"{where}.content", content)}


def _template_tool_call(call: Any) -> Any:
    """A tool call with its `function.arguments` as an object, as templates expect (vLLM and
    transformers both hand templates parsed arguments; OpenAI sends them as JSON text)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def _text_content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(
                f'{where}[{j}] must be {{"type": "text", "text": <string>}}; got {part!r:.80}'
            )
        texts.append(part["text"])
    # Templates expect a string; vLLM joins text parts with newlines, so the same request
    # gives the same prompt there.
    return "\n".join(texts)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    # As in transformers, a chat_template.jinja file wins over the template in the config.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        if "default" not in named:
            raise ChatTemplateError(
                f"{model_dir / 'tokenizer_config.json'}: chat templates {sorted(named)} "
                "include none named 'default'"
            )
        return named["default"]
    return template


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """bos_token/eos_token as written in tokenizer_config.json: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, Mapping) else token


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _bos_eos_processor(
    backend: BackendTokenizer, bos_token: str | None, eos_token: str | None
) -> processors.TemplateProcessing | None:
    """A post-processor putting bos before and eos after the text, or None if neither."""
    if bos_token is None and eos_token is None:
        return None
    single = " ".join(token for token in (bos_token, "$A", eos_token) if token is not None)
    special = [(t, _token_id(backend, t)) for t in (bos_token, eos_token) if t is not None]
    return processors.TemplateProcessing(single=single, special_tokens=special)


def _token_id(backend: BackendTokenizer, token: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
    return token_id
