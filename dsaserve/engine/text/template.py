"""A checkpoint's Jinja chat template, rendered the way transformers' `apply_chat_template` does.

Templates come with checkpoints: they are compiled in jinja2's immutable sandbox, get the
filters and globals transformers gives them (`tojson` with its options, `raise_exception`,
`strftime_now`), and see OpenAI messages as transformers hands them over (null fields dropped,
text parts joined, tool-call arguments parsed), so a prompt renders here as it would there.
Torch-free, like all of engine.text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """Chat messages the template cannot take, or a chat template that failed to render."""


class ChatTemplate:
    """One compiled chat template (ChatTemplateError at once if its syntax is wrong)."""

    def __init__(self, source: str) -> None:
        self._template = _compile_template(source)
        # The names it reads from its context besides the messages (request variables).
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(_JINJA.parse(source)))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any],
        tokens: Mapping[str, str],
    ) -> str:
        """The prompt text of `messages`; `variables` are a request's template variables,
        `tokens` the bos/eos strings transformers passes every template."""
        plain_messages = _validate_messages(messages)
        reserved = sorted(_RESERVED_VARIABLES & variables.keys())
        if reserved:
            raise ChatTemplateError(f"template variables may not be named {', '.join(reserved)}")
        try:
            # transformers always passes tools and documents; templates test `tools is none`.
            return self._template.render(
                **tokens,
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
    if not isinstance(function, Mapping) or not isinstance(
        arguments := function.get("arguments"), str
    ):
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


def read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
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
