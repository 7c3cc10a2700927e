"""A checkpoint's tokenizer without torch: text <-> token ids, and chat messages -> prompt.

The router renders chat templates and counts prompt tokens before any GPU work, and it must start
without torch; so this module depends only on `tokenizers` (and engine.text.template on
`jinja2`). It reads the files a Hugging Face checkpoint ships and renders their chat template
(engine.text.template), so a prompt tokenizes here exactly as it would in transformers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, processors

from dsaserve.engine.text import token_bound
from dsaserve.engine.text.template import ChatTemplate, ChatTemplateError, read_chat_template

_SURROGATE = re.compile("[\ud800-\udfff]")


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
        self._template = None if chat_template is None else ChatTemplate(chat_template)
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
            chat_template=read_chat_template(model_dir, config),
            bos_token=bos_token,
            eos_token=eos_token,
            extra_eos_token_ids=extra_eos_ids,
        )

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json spells it (what llguidance builds its own from)."""
        return self._backend.to_str()

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
        """The most text characters one token covers, or None if unknown
        (engine.text.token_bound): a text of n characters encodes to at least ceil(n / this)
        tokens. Reads the whole vocabulary: call it once."""
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
            piece = self._backend.id_to_token(token_id)
            if piece is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            return bytes(self._byte_of[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (empty without a template)."""
        return frozenset() if self._template is None else self._template.variables

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
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
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            variables=variables or {},
            tokens=self._template_tokens,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt token ids for `messages`: the rendered template, special tokens included."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        # The template writes bos itself; adding special tokens would put a second one in front.
        return self.encode(prompt, add_special_tokens=False)


def byte_level_alphabet() -> list[str]:
    """ByteLevel's stand-in character for each byte, indexed by byte value (GPT-2's map)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), 256))
    unprintable = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(unprintable)}
    return [chars[b] for b in range(256)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


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
