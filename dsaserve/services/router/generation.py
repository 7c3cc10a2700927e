"""One request's generations, launched: what every generating route shares (chat and text
completions, the Messages and Responses APIs), up to the events of its choices.

A refusal at capacity (429) -> API key limit -> model name -> chat format + tokenize -> context
check -> admission -> one generation per choice: room on the decode side (decode_room) ->
prefill worker (policy) -> Prefill -> first token out -> Decode stream.
Each route then writes the events in its own API's shapes.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request

from dsaserve.services.router.api.errors import APIError
from dsaserve.services.router.api.logprobs import PromptLogprobs, TokenTexts
from dsaserve.services.router.api.schemas import ChatCompletionRequest, CompletionRequest
from dsaserve.services.router.api.streaming import cancelled_on_disconnect
from dsaserve.services.router.choices import ChatChoice, Choice, Echo, TextChoice
from dsaserve.services.router.fanout import Indexed, fan_in
from dsaserve.services.router.metrics import RequestTimer
from dsaserve.services.router.pd import Generation
from dsaserve.services.router.state import router_state
from dsaserve.services.router.structured import reply_grammar_of
from dsaserve.services.router.tenancy import cache_namespace


@dataclass
class Launched:
    request_id: str
    model: str  # the served name
    choices: list[Choice]  # as `events` index them
    events: AsyncGenerator[Indexed, None]  # every generation's first event already arrived
    prompt_tokens: int  # each prompt counted once


async def launch(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    id_prefix: str,
    prompt_param: str,
    slots: contextlib.ExitStack,
) -> Launched:
    """Start the request's generations; what they hold (the key's and the admission's slots)
    is released by `slots`. Every prefill happens here, so their errors keep their HTTP
    status. Until the answer starts, a client that hangs up is noticed only here: it cancels
    the launch (admission wait, tokenizing, prefill)."""
    async with cancelled_on_disconnect(request):
        arrival = time.monotonic()
        st = router_state(request)
        st.model.check_name(body.model)
        key = request.state.api_key
        st.admission.refuse_if_full(arrival)  # before tokenizing: a refusal costs nothing
        st.key_limit.acquire(key)  # (so does a key over its limit)
        slots.callback(st.key_limit.release, key)
        texts = TokenTexts(st.model.tokenizer)
        logprob_texts = texts if body.logprobs_count() is not None else None
        choices: list[Choice] = []
        prompts: list[list[int]] = []  # each choice's
        if isinstance(body, ChatCompletionRequest):
            prompt, prompt_ids = await st.model.chat_ids(body)
            scored = _prompt_logprobs(texts, prompt_ids, body.prompt_logprobs)
            choices = [
                ChatChoice(i, prompt, logprob_texts, scored, st.model.think_end_id)
                for i in range(body.n)
            ]
            prompts = [prompt_ids] * body.n
            grammar = await reply_grammar_of(
                body.response_format, prompt, st.grammars, body.thinking_token_budget
            )
        else:
            grammar = await reply_grammar_of(body.response_format, None, st.grammars)
            # Batched prompts: one choice per prompt and n, prompt-major (vLLM's order).
            for ids, text in await st.model.completion_prompts(body):
                echo = Echo(text, ids, body.logprobs) if body.echo else None
                scored = _prompt_logprobs(texts, ids, body.prompt_logprobs)
                for _ in range(body.n):
                    choices.append(TextChoice(len(choices), logprob_texts, echo, scored))
                    prompts.append(ids)
        _check_prompt_entries(body, prompts, st.settings.max_prompt_entries)
        requested = body.requested_max_tokens()
        budgets = [st.model.max_tokens(len(ids), requested, prompt_param) for ids in prompts]
        timeout_s = st.settings.request_timeout_s
        # One admission slot per request, whatever its n.
        await st.admission.acquire(arrival + timeout_s - time.monotonic())
        slots.callback(st.admission.release)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        namespace = cache_namespace(request.state.tenant, body.cache_salt, st.settings.cache_by_key)
        generations = [
            Generation(
                # Workers key requests by id: each choice is a request of its own there.
                request_id=request_id if len(choices) == 1 else f"{request_id}-{i}",
                prompt_ids=ids,
                # max_tokens 0 (echo): the prompt's logprobs need one prefill step anyway
                sampling=body.sampling(max(budget, 1), i % body.n, grammar, namespace),
                deadline=arrival + timeout_s,
                timeout_s=timeout_s,
                timer=RequestTimer(st.metrics, arrival),
                prompt_only=budget == 0,
            )
            for i, (ids, budget) in enumerate(zip(prompts, budgets, strict=True))
        ]
        events = await fan_in([st.flow.generate(gen) for gen in generations])
        prompt_tokens = sum(len(ids) for ids in prompts[:: body.n])
        return Launched(request_id, st.model.name, choices, events, prompt_tokens)


def _check_prompt_entries(
    body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], limit: int
) -> None:
    """A 400 before any work for a request whose answer would carry more than `limit` entries
    about its prompts (prompt logprobs, echoed prompts and their logprobs, every generation's):
    a small request could otherwise make the router and workers build an answer of gigabytes."""
    per_token = body.prompt_entries_per_token()
    entries = per_token * sum(len(ids) for ids in prompts)
    if entries > limit:
        asked = {
            "prompt_logprobs": body.prompt_logprobs is not None,
            "echo": getattr(body, "echo", False),
            "logprobs": body.logprobs_count() is not None,
            "n": body.n > 1,
        }
        fields = [name for name, given in asked.items() if given]
        raise APIError(
            400,
            f"The answer would carry {entries} entries about the prompts ({', '.join(fields)}: "
            f"{per_token} per prompt token, over {len(prompts)} generations of "
            f"{sum(len(ids) for ids in prompts)} prompt tokens in all); at most {limit} per "
            "request (--max-prompt-entries). Ask for fewer alternatives, prompts or choices.",
            param=fields[0],
            code="too_many_prompt_entries",
        )


def _prompt_logprobs(texts: TokenTexts, ids: list[int], k: int | None) -> PromptLogprobs | None:
    return None if k is None else PromptLogprobs(texts, ids, k)
