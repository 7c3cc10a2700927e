"""OpenAI request fields the router accepts without implementing them, and only at no-op values.

Client libraries often send fields at their defaults (`presence_penalty: 0`, `logit_bias: {}`):
refusing those would break them for nothing. Silently ignoring a value that means something
(`logit_bias: {"50256": -100}`) would instead answer a question the client did not ask. So each
field here says which values change nothing; those are dropped before validation, and any other
value is a 400 naming the field. A field in neither these tables nor the schemas is refused as
unknown (the schemas forbid extra fields).

To implement a field: declare it on its schema in `schemas.py` and delete its line here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NoOp:
    """The values of an unimplemented field that change nothing, and how an error names them."""

    values: tuple[Any, ...]

    def __call__(self, value: object) -> bool:
        # Compare types too: `0 == False`, but `logprobs: 0` asks for something on completions.
        return value is None or any(type(value) is type(v) and value == v for v in self.values)

    def describe(self) -> str:
        return " or ".join([*(json.dumps(v) for v in self.values), "null"])


ZERO = NoOp((0, 0.0))
NULL = NoOp(())
FALSE = NoOp((False,))
EMPTY_LIST = NoOp(([],))
EMPTY_OBJECT = NoOp(({},))

# Both generation routes.
GENERATION: Mapping[str, NoOp] = {
    "store": FALSE,
    "metadata": EMPTY_OBJECT,  # only used with store
    "service_tier": NoOp(("auto", "default")),
    # vLLM/SGLang extensions, at their defaults
    "skip_special_tokens": NoOp((True,)),
    "spaces_between_special_tokens": NoOp((True,)),
    "include_stop_str_in_output": FALSE,
    "use_beam_search": FALSE,
    "length_penalty": NoOp((1, 1.0)),
    "truncate_prompt_tokens": NULL,
    "priority": NoOp((0,)),
    "return_tokens_as_token_ids": FALSE,
    "return_token_ids": FALSE,
    "logits_processors": NULL,
    "kv_transfer_params": NULL,
    "vllm_xargs": NULL,
}

# /v1/chat/completions only.
CHAT: Mapping[str, NoOp] = {
    **GENERATION,
    "functions": EMPTY_LIST,
    "function_call": NoOp(("none", "auto")),
    "modalities": NoOp((["text"],)),
    "audio": NULL,
    "prediction": NULL,
    "web_search_options": NULL,
    # vLLM's chat extensions, at their defaults
    "echo": FALSE,
    "add_special_tokens": FALSE,
    "documents": NULL,
    "chat_template": NULL,
    "mm_processor_kwargs": NULL,
}

# /v1/completions only.
COMPLETION: Mapping[str, NoOp] = {
    **GENERATION,
    "best_of": NoOp((1,)),
    "suffix": NoOp(("",)),
}

# A chat message, and `stream_options`.
MESSAGE: Mapping[str, NoOp] = {
    "name": NULL,
    "function_call": NULL,
    "refusal": NULL,
}
STREAM_OPTIONS: Mapping[str, NoOp] = {
    "include_obfuscation": FALSE,
}

# /v1/responses.
RESPONSES: Mapping[str, NoOp] = {
    "background": FALSE,
    "conversation": NULL,
    "prompt": NULL,
    "top_logprobs": ZERO,
    "service_tier": NoOp(("auto", "default")),
    "prompt_cache_retention": NULL,
    "max_tool_calls": NULL,
    "context_management": NULL,
    "stream_options": NoOp(({"include_obfuscation": False},)),
}

_ALL = (CHAT, COMPLETION, MESSAGE, STREAM_OPTIONS, RESPONSES)


def drop_no_ops(data: object, table: Mapping[str, NoOp], declared: Callable[[str], bool]) -> object:
    """`data` without the undeclared fields of `table` whose value changes nothing.

    What is left over and undeclared, the schema refuses as an extra field.
    """
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if declared(k) or k not in table or not table[k](v)}


def unsupported_message(name: str, param: str) -> str:
    """The 400 for an extra field `name` at `param`: unimplemented (with its no-op values) or
    unknown."""
    no_op = next((t[name] for t in _ALL if name in t), None)
    if no_op is None:
        return f"Unrecognized request argument supplied: {param}"
    return (
        f"'{param}' is not supported by this server; it is accepted only as "
        f"{no_op.describe()}, which changes nothing"
    )
