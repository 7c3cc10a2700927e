"""The grammar a constrained chat reply follows: JSON content, DSML tool calls, after reasoning.

A request constrains its reply with `response_format` (the content is JSON: any object, or a
schema's), with `tool_choice` "required" or a named function (the reply is a DSML call of those
tools), or with `strict` tools (a call the model chooses to make has arguments of the tool's
schema). `reply_grammar` turns that into one llguidance grammar over the whole reply, as the
chat format writes it (see `dsml`):

    [reasoning </think>] ( content | JSON | [content] "\\n\\n<｜DSML｜tool_calls>\\n" invoke ... )

- Reasoning comes first, free, in thinking mode: the constraint starts where it ends. The
  `</think>` token ends it; EOS cannot (a constraint is pending until its part is complete, so
  the reply ends in JSON or a call, or is cut by max_tokens). `thinking_token_budget` (vLLM's
  field) bounds it: after that many tokens `</think>` is the only token left.
- Free text (reasoning, content before calls, a string parameter's value) never holds the
  `｜DSML｜` marker, so the reply parser reads exactly the structure the grammar made.
- A call's parameters follow its tool's `parameters` schema, properties in the schema's order,
  each required one present: a plain string (`{"type": "string"}`) is written as the release
  writes strings (string="true", raw text); any other value as JSON (string="false") under its
  own subschema (with the schema's `$defs`), so the arguments the parser assembles always
  validate.
- A strict schema is compiled exactly, and a keyword llguidance does not implement is an
  error naming it; a non-strict one leniently (unknown keywords ignored), as vLLM does.
- Either way, a schema with no finite instance (a `$ref` cycle with no way out,
  engine.text.schema_bounds) is an error naming its refs, and the grammar may not grow past
  `max_bytes` (a tool's `$defs` go with each of its parameters, so many parameters of a schema
  with large definitions would otherwise multiply it).

llguidance's lexer does not split one free-text lexeme from a literal that follows it, so free
text and what ends it are one terminal (`CONTENT_THEN_CALLS`, `STRING_VALUE`); a marker that
is a special token of the tokenizer (`</think>`) is matched as that token (`<[id]>`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from dsaserve.engine.text.chat.dsml import Dialect
from dsaserve.engine.text.chat.tokens import (
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    THINK_END,
)
from dsaserve.engine.text.chat.tokens import PARAMETER_OPEN as PARAM_OPEN
from dsaserve.engine.text.grammar import GrammarCompiler, GrammarError
from dsaserve.engine.text.schema_bounds import unending_refs

# Keywords that leave a string parameter plain text (the release's string="true" form).
_PLAIN_STRING_KEYS = frozenset({"type", "description", "title", "default", "examples"})
# Keywords a strict tool's `parameters` may have (an object of named properties).
_PARAMETERS_KEYS = frozenset(
    {"type", "properties", "required", "additionalProperties", "description", "title"}
)
_DEFS = ("$defs", "definitions")
# JSON as Python's json.dumps writes it: ", " and ": " between items, no other whitespace. Free
# whitespace lets a model that favours it fill max_tokens with it (a known way constrained
# decoding loops, and why vLLM has --disable-any-whitespace); this way it writes only values.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TAG_BREAKERS = frozenset('"<>\n')
_TRUE, _FALSE = '"true">', '"false">'  # a parameter tag's ends: raw text, or JSON


@dataclass(frozen=True)
class JsonContent:
    """The reply's content is JSON: an object (`schema` None, OpenAI's json_object) or
    `schema`'s (json_schema); `strict` compiles the schema exactly."""

    schema: Mapping[str, Any] | None
    strict: bool
    param: str  # the request field it came from, for errors


@dataclass(frozen=True)
class ToolSchema:
    name: str
    parameters: Mapping[str, Any] | None  # a JSON schema of an object, or None: no arguments
    strict: bool  # arguments constrained exactly to `parameters`
    param: str  # the request field it came from, for errors


@dataclass(frozen=True)
class ReplyConstraint:
    json: JsonContent | None = None
    tools: tuple[ToolSchema, ...] = ()  # the tools a call may name (empty: no calls)
    calls_required: bool = False  # the reply is calls ("required" or a named function)
    single_call: bool = False  # one call at most (parallel_tool_calls false, a named function)
    thinking_token_budget: int | None = None  # the most tokens the reasoning may take

    def constrains(self, opens_reasoning: bool) -> bool:
        return (
            self.json is not None
            or self.calls_required
            or any(tool.strict for tool in self.tools)
            or (opens_reasoning and self.thinking_token_budget is not None)
        )


MAX_GRAMMAR_BYTES = 4 << 20


def reply_grammar(
    constraint: ReplyConstraint,
    compiler: GrammarCompiler,
    dialect: Dialect,
    opens_reasoning: bool,
    max_bytes: int = MAX_GRAMMAR_BYTES,
) -> str | None:
    """The grammar of the whole reply (None when nothing constrains it); raises GrammarError
    (its `param` the request field at fault) for a schema or a format it cannot constrain, or a
    grammar that would be longer than `max_bytes`."""
    if not constraint.constrains(opens_reasoning):
        return None
    g = _Writer(compiler, max_bytes)
    body = []
    if constraint.json is not None and not constraint.calls_required:
        body.append(g.json(constraint.json.schema, constraint.json.strict, constraint.json.param))
    if constraint.tools:
        calls = " | ".join(g.invoke(tool, constraint.calls_required) for tool in constraint.tools)
        g.rules += [f"invoke: {calls}", f"STRING_VALUE: NODSML {_lit(PARAMETER_CLOSE)}"]
        invokes = "invoke" if constraint.single_call else 'invoke ("\\n" invoke)*'
        opening, closing = _lit(f"\n\n{dialect.open}\n"), _lit(f"\n{dialect.close}")
        if constraint.json is None and not constraint.calls_required:
            # content, or content then calls: one terminal up to the block's opening
            g.rules.append(f"CONTENT_THEN_CALLS: NODSML {opening}")
            body += ["NODSML", f"CONTENT_THEN_CALLS {invokes} {closing}"]
        else:
            body.append(f"{opening} {invokes} {closing}")
    if not body:  # only the reasoning is bounded: the rest is free
        body.append("/(?s:.*)/")
    start = "body"
    if opens_reasoning:
        start = f"{g.reasoning(constraint.thinking_token_budget)} body"
    lines = [f"start: {start}", f"body: {' | '.join(body)}", f"NODSML: {_NO_DSML}", *g.rules]
    return "\n".join(lines) + "\n"


# Any text without the DSML marker (the parser would read markup in it).
_NO_DSML = f"/(?s:.*)/ & ~/(?s:.*){DSML}(?s:.*)/"


def _lit(text: str) -> str:
    """A grammar string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


class _Writer:
    """Rules of one grammar, named as they are made."""

    def __init__(self, compiler: GrammarCompiler, max_bytes: int) -> None:
        self._compiler = compiler
        self._room = max_bytes  # what the schemas written so far leave of the size bound
        self.rules: list[str] = []

    def reasoning(self, budget: int | None) -> str:
        """Free text up to and including `</think>`: its token where it is a special token
        (which text never matches; then `budget` tokens at most), else one terminal with it."""
        token = self._compiler.special_token(THINK_END)
        if token is not None:
            bound = "" if budget is None else f"[max_tokens={budget}]"
            self.rules.append(f"reasoning{bound}: NODSML")
            return f"reasoning <[{token}]>"
        if budget is not None:
            raise GrammarError(
                f"thinking_token_budget needs {THINK_END} as one special token of the tokenizer",
                param="thinking_token_budget",
            )
        self.rules.append(f"REASONING: NODSML {_lit(THINK_END)}")
        return "REASONING"

    def json(self, schema: Mapping[str, Any] | None, strict: bool, param: str) -> str:
        """A JSON value of `schema` (None: any object): one with a finite instance, checked
        now when strict."""
        schema = {"type": "object"} if schema is None else dict(schema)
        if refs := unending_refs(schema):
            named = ", ".join(repr(r) for r in refs[:3]) + (" ..." if len(refs) > 3 else "")
            raise GrammarError(
                f"{param}: the schema has no finite instance: every value of {named} must "
                "contain another (a $ref cycle with no way out)",
                param=param,
            )
        if strict:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            except ValueError as e:  # not a JSON object
                raise GrammarError(f"{param}: {e}", param=param) from None
            error = llguidance.LLMatcher.validate_grammar(grammar)
            if error and not error.startswith("WARNING"):
                raise GrammarError(f"{param}: {error}", param=param)
        schema["x-guidance"] = {"lenient": not strict, **_JSON_LAYOUT}
        text = f"%json {json.dumps(schema, ensure_ascii=False)}"
        self._room -= len(text)
        if self._room < 0:
            raise GrammarError(
                f"{param}: the reply's grammar would be larger than the router allows "
                "(--max-grammar-bytes); send smaller schemas, or fewer parameters sharing "
                "large $defs",
                param=param,
            )
        return text

    def invoke(self, tool: ToolSchema, forced: bool) -> str:
        """The rule name of one call of `tool`; its arguments follow the schema where the tool
        is strict or the call is forced, any parameters otherwise."""
        name = f"call_{len(self.rules)}"
        head = _lit(f'{INVOKE_OPEN} name="{tool.name}">\n')
        schema = tool.parameters
        if schema is None:
            params = _lit("\n")  # no arguments, as the encoder writes such a call
        elif (tool.strict or forced) and _is_object_of_properties(schema, tool):
            params = self._parameters(schema, tool)
        else:
            params = "any_parameter*"
            if not any(rule.startswith("any_parameter:") for rule in self.rules):
                self.rules.append(f"any_parameter: {self._any_parameter()}")
        self.rules.append(f"{name}: {head} {params} {_lit(INVOKE_CLOSE)}")
        return name

    def _parameters(self, schema: Mapping[str, Any], tool: ToolSchema) -> str:
        properties: Mapping[str, Any] = schema.get("properties") or {}
        if not properties:
            return _lit("\n")  # as the encoder writes a call without arguments
        required = set(schema.get("required") or ())
        defs = {k: schema[k] for k in _DEFS if k in schema}
        parts = []
        for key, sub in properties.items():
            where = f"{tool.param}.properties.{key}"
            sub = {} if sub is True else sub  # (JSON Schema's `true`: any value)
            if not isinstance(sub, Mapping):
                raise GrammarError(f"{where} must be a JSON schema object", param=tool.param)
            if _TAG_BREAKERS.intersection(key):  # it goes into a DSML tag's name="..."
                raise GrammarError(
                    f'{where}: a parameter name cannot hold " < > or a newline', param=tool.param
                )
            opening = f'{PARAM_OPEN} name="{key}" string='
            if sub.get("type") == "string" and set(sub) <= _PLAIN_STRING_KEYS:
                value = f"{_lit(opening + _TRUE)} STRING_VALUE"
            else:
                json_value = self.json({**sub, **defs}, tool.strict, where)
                value = f"{_lit(opening + _FALSE)} {json_value} {_lit(PARAMETER_CLOSE)}"
            rule = f"param_{len(self.rules)}"
            self.rules.append(f'{rule}: {value} "\\n"')
            parts.append(rule if key in required else f"{rule}?")
        return " ".join(parts)

    def _any_parameter(self) -> str:
        opening = _lit(f'{PARAM_OPEN} name="')
        string = _lit(f'" string={_TRUE}') + " STRING_VALUE"
        value = _lit(f'" string={_FALSE}') + f" %json {{}} {_lit(PARAMETER_CLOSE)}"
        return f'{opening} /[^"<>\\n]+/ ({string} | {value}) "\\n"'


def _is_object_of_properties(schema: Mapping[str, Any], tool: ToolSchema) -> bool:
    """Whether a call's arguments can follow `schema` (an object of named properties): a strict
    tool's must (else GrammarError); a forced call of another tool takes any arguments if not."""
    unsupported = sorted(set(schema) - _PARAMETERS_KEYS - set(_DEFS))
    if schema.get("type", "object") != "object":
        unsupported.insert(0, "type")
    if not isinstance(schema.get("properties", {}), Mapping):
        unsupported.insert(0, "properties")
    if not isinstance(schema.get("required", []), list):
        unsupported.insert(0, "required")
    if tool.strict and schema.get("additionalProperties", False) is not False:
        unsupported.append("additionalProperties")  # (OpenAI's strict mode also refuses it)
    if not unsupported:
        return True
    if tool.strict:
        raise GrammarError(
            f"{tool.param}: a strict tool's parameters must be an object of named properties; "
            f"{', '.join(repr(k) for k in unsupported)} is not supported",
            param=tool.param,
        )
    return False


def tool_schemas(
    tools: Sequence[Mapping[str, Any]], param: str = "tools"
) -> tuple[ToolSchema, ...]:
    """OpenAI tool definitions as `ToolSchema`s."""
    return tuple(
        ToolSchema(
            name=tool["function"]["name"],
            parameters=tool["function"].get("parameters"),
            strict=bool(tool["function"].get("strict")),
            param=f"{param}[{i}].function.parameters",
        )
        for i, tool in enumerate(tools)
    )
