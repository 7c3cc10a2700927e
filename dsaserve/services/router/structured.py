"""Structured outputs at the router: a request's `response_format` and tools become the grammar
its reply follows (engine.text.chat.constraint), built and compiled here first (in the grammar
processes, under a time and size budget: grammars.py), so that a schema the grammar library
cannot honour, or honour in budget, is a 400 naming what it cannot before any worker sees the
request. The grammar then travels in the request's sampling params; the prefill worker samples
the first token under it and the decode worker resumes it (engine.structured).
"""

from __future__ import annotations

from dataclasses import replace

from dsaserve.engine.text.chat import V4_DSML
from dsaserve.engine.text.chat.constraint import JsonContent, ReplyConstraint
from dsaserve.engine.text.grammar import GrammarError
from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.api.schemas import JsonObjectFormat, JsonSchemaFormat, ResponseFormat
from dsaserve.services.router.chat import ChatPrompt
from dsaserve.services.router.grammars import GrammarBuilder, GrammarJob

_PARAM = "response_format"


async def reply_grammar_of(
    response_format: ResponseFormat | None,
    prompt: ChatPrompt | None,
    grammars: GrammarBuilder,
    thinking_token_budget: int | None = None,
) -> str | None:
    """The grammar of a chat reply (`prompt`) or of a completion's text (None), or None when
    nothing constrains it; APIError 400 for what cannot be constrained."""
    json = _json_content(response_format)
    if prompt is None:  # a completion: the whole text is the content
        constraint, dialect, opens_reasoning = ReplyConstraint(json=json), V4_DSML, False
    else:
        constraint = replace(prompt.calls, json=json, thinking_token_budget=thinking_token_budget)
        dialect, opens_reasoning = prompt.dialect, prompt.opens_reasoning
    if not constraint.constrains(opens_reasoning):
        return None  # (nothing to build: no grammar process is asked)
    try:
        grammar = await grammars.build(GrammarJob(constraint, dialect, opens_reasoning))
    except GrammarError as e:
        param = e.param or (_PARAM if json is not None else "tools")
        raise APIError(400, f"Cannot constrain the reply: {e}", param=param) from None
    return grammar


def _json_content(response_format: ResponseFormat | None) -> JsonContent | None:
    if isinstance(response_format, JsonObjectFormat):
        return JsonContent(None, strict=False, param=_PARAM)
    if isinstance(response_format, JsonSchemaFormat):
        spec = response_format.json_schema
        return JsonContent(
            spec.schema_, strict=bool(spec.strict), param=f"{_PARAM}.json_schema.schema"
        )
    return None
