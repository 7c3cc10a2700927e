"""The router's FastAPI app: OpenAI routes, vLLM's /tokenize and /detokenize, /health, /metrics,
and the objects they share.

A request goes: API key -> body validation -> a 429 at capacity -> model name -> chat format +
tokenize -> context check -> admission -> one generation per choice: room on the decode side ->
prefill worker (policy) -> Prefill -> first token out -> Decode stream.
"""

from __future__ import annotations

import contextlib
import hmac
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry

from dsaserve.services.kv_events import CacheIndex
from dsaserve.services.metrics import exposition
from dsaserve.services.registry import ROLES, RegistryWatcher
from dsaserve.services.router.admission import Admission, KeyLimit
from dsaserve.services.router.api.anthropic import messages as anthropic
from dsaserve.services.router.api.body import LimitedRoute
from dsaserve.services.router.api.envelopes import Reply
from dsaserve.services.router.api.errors import APIError, error_responses, install_handlers
from dsaserve.services.router.api.logprobs import TokenTexts
from dsaserve.services.router.api.responses import routes as responses_api
from dsaserve.services.router.api.responses.store import ResponseStore
from dsaserve.services.router.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from dsaserve.services.router.api.streaming import EventStream, OpenAIStream, answer
from dsaserve.services.router.clients import WorkerClients
from dsaserve.services.router.decode_room import DecodeRoom
from dsaserve.services.router.generation import launch
from dsaserve.services.router.grammars import GrammarBuilder
from dsaserve.services.router.metrics import RequestCounter, RouterMetrics
from dsaserve.services.router.model import ServedModel
from dsaserve.services.router.pd import PDFlow
from dsaserve.services.router.selection import WorkerSelector
from dsaserve.services.router.settings import RouterSettings
from dsaserve.services.router.state import RouterState, router_state
from dsaserve.services.router.tenancy import tenant_of


def create_app(
    settings: RouterSettings,
    rng: random.Random | None = None,
    *,
    start_grammar_processes: bool = False,
) -> FastAPI:
    """Build the app; the registry watcher starts and stops with the app's lifespan, and so do
    the grammar processes with `start_grammar_processes` (else with the first grammar)."""
    s = settings
    model = ServedModel.load(s.model_dir, s.served_model_name, s.max_model_len, s.default_thinking)
    metrics = RouterMetrics(CollectorRegistry())
    watcher = RegistryWatcher(s.redis_url, s.cluster_token, s.registry_ttl_s)
    cache = (
        CacheIndex(
            s.redis_url,
            lambda: [w.worker_id for r in ROLES for w in watcher.workers(r, model.name)],
        )
        if s.policy == "cache_aware"
        else None
    )
    clients = WorkerClients(s.cluster_token, s.tls)
    admission = Admission(s.max_inflight, s.max_queue, s.max_queue_delay_s)
    metrics.track_admission(lambda: admission.waiting, lambda: admission.inflight)
    metrics.track_registry(lambda: watcher.up, watcher.last_refresh_age_s)
    selector = WorkerSelector(
        watcher,
        model.name,
        s.policy,
        clients.inflight,
        rng,
        on_mark=lambda worker, reason: metrics.marked_unhealthy.labels(worker.role, reason).inc(),
        cache=cache,
        balance_bound=s.balance_abs_threshold,
        decode_kv_threshold=s.decode_kv_threshold,
    )
    key_limit = KeyLimit(s.key_limit)
    room = DecodeRoom(
        lambda: selector.live("decode"),
        s.decode_kv_threshold,
        s.max_queue_delay_s,
        selector.retry_after_s,
    )
    flow = PDFlow(selector, clients, s.stall_timeout_s, room)
    store = ResponseStore(s.redis_url, s.response_ttl_s)
    grammars = GrammarBuilder(s.model_dir, s.grammar_compile_timeout_s, s.max_grammar_bytes)
    state = RouterState(
        s, model, metrics, watcher, clients, admission, key_limit, selector, flow, store, grammars
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await watcher.start()
        if cache is not None:
            cache.start()
        if start_grammar_processes:
            grammars.start()
        try:
            yield
        finally:
            await grammars.stop()
            if cache is not None:
                await cache.stop()
            await watcher.stop()
            await clients.close()
            await store.close()

    app = FastAPI(title="dsaserve router", lifespan=lifespan)
    app.state.router = state
    install_handlers(
        app, dict.fromkeys((anthropic.PATH, anthropic.COUNT_TOKENS_PATH), anthropic.error_body)
    )
    app.add_middleware(RequestCounter, metrics=metrics)
    app.include_router(_v1)
    app.include_router(anthropic.router, dependencies=[Depends(_require_api_key)])
    app.include_router(responses_api.router, dependencies=[Depends(_require_api_key)])
    app.include_router(_tokens)
    app.include_router(_ops)
    return app


_state = router_state


async def _require_api_key(request: Request) -> None:
    """Let the request through with a valid key (then `request.state.api_key` is that key and
    `request.state.tenant` its tenant, tenancy.py)."""
    request.state.api_key = request.state.tenant = None
    keys = _state(request).settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if "x-api-key" in request.headers:  # Anthropic's header
        scheme, token = "bearer", request.headers["x-api-key"]
    presented = token.strip().encode()
    # compare_digest on every key: the time taken must not reveal how much of a key matched.
    valid = [hmac.compare_digest(presented, key.encode()) for key in keys]
    request.state.api_key = next((k for k, ok in zip(keys, valid, strict=True) if ok), None)
    request.state.tenant = tenant_of(request.state.api_key)
    if scheme.lower() != "bearer" or request.state.api_key is None:
        raise APIError(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>' (or "
            "'x-api-key: <key>') with a key the router was given (--api-key).",
            code="invalid_api_key",
        )


_v1 = APIRouter(
    prefix="/v1",
    dependencies=[Depends(_require_api_key)],
    route_class=LimitedRoute,
    responses=error_responses(401),
)
# vLLM serves these at the root; they take the API key like /v1.
_tokens = APIRouter(
    dependencies=[Depends(_require_api_key)],
    route_class=LimitedRoute,
    responses=error_responses(400, 401, 404, 413),
)
_ops = APIRouter()

_GENERATED = {
    200: {
        "description": "The completion: one JSON object, or with `stream` an SSE stream",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **error_responses(400, 401, 404, 413, 429, 503, 504),
}


@_v1.post("/chat/completions", responses=_GENERATED)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _generate(request, body, "chatcmpl", "messages")


@_v1.post("/completions", responses=_GENERATED)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _generate(request, body, "cmpl", "prompt")


async def _generate(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    id_prefix: str,
    prompt_param: str,
) -> Response:
    # What the request holds is released when its answer is complete: by the stream once it
    # owns them, else on leaving this block.
    with contextlib.ExitStack() as slots:
        run = await launch(request, body, id_prefix, prompt_param, slots)
        reply = Reply(
            run.request_id,
            run.model,
            body.include_usage,
            run.choices,
            run.prompt_tokens,
            body.continuous_usage,
        )
        if body.stream:
            # From here the stream owns the slots and the generations.
            return EventStream(
                run.events, OpenAIStream(reply), request.state, slots.pop_all().close
            )
        try:
            return await answer(run.events, reply.feed, reply.answer_parts, request)
        finally:
            await run.events.aclose()


@_tokens.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: a chat's prompt ids exactly as a chat completion sends them to prefill
    (the same code renders both), or a text prompt's as a completion's."""
    model = _state(request).model
    model.check_name(body.model)
    if isinstance(body, TokenizeChatRequest):
        _, ids = await model.chat_ids(body)
    else:
        ids = await model.text_ids(body.prompt, body.add_special_tokens)
    texts = TokenTexts(model.tokenizer)
    return {
        "count": len(ids),
        "max_model_len": model.context_length,
        "tokens": ids,
        "token_strs": [texts.token(i) for i in ids] if body.return_token_strs else None,
    }


@_tokens.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    """vLLM's /detokenize: the text of token ids, special tokens included (undoes /tokenize)."""
    model = _state(request).model
    model.check_name(body.model)
    model.check_ids(body.tokens, "tokens")
    return {"prompt": model.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@_v1.get("/models")
async def models(request: Request) -> dict[str, Any]:
    model = _state(request).model
    card = {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "dsaserve",
        "root": model.name,  # (vLLM puts the model's path here; a client has no use for ours)
        "max_model_len": model.context_length,
    }
    return {"object": "list", "data": [card]}


@_ops.get("/live")
async def live() -> dict[str, str]:
    """The process answers (Kubernetes' liveness probe); /health says whether it can serve."""
    return {"status": "ok"}


@_ops.get(
    "/health",
    responses={503: {"description": "No prefill and decode worker pair can serve now"}},
)
async def health(request: Request) -> JSONResponse:
    """200 while a prefill and a decode worker can serve; says whether Redis is reachable
    (while it is not, the router serves with the workers it last saw), what it ignored there,
    and how often the registry watcher restarted after an error."""
    st = _state(request)
    reason = st.selector.unavailable_reason()
    body: dict[str, Any] = {
        "status": "ok" if reason is None else "unavailable",
        "model": st.model.name,
        "workers": {role: len(st.selector.live(role)) for role in ROLES},
        "unhealthy_workers": {role: len(st.selector.unhealthy(role)) for role in ROLES},
        "registry": {
            "up": st.watcher.up,
            "last_refresh_age_s": round(st.watcher.last_refresh_age_s(), 3),
            # entries under worker keys that are no trusted record (forged, stale, malformed)
            "ignored_entries": st.watcher.untrusted,
            "watcher_restarts": st.watcher.restarts,
            "watcher_last_error": st.watcher.last_error,
        },
    }
    if reason is not None:
        body["message"] = reason
    return JSONResponse(body, status_code=200 if reason is None else 503)


@_ops.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    st = _state(request)
    st.metrics.set_workers(
        lambda role: len(st.selector.live(role)), lambda role: len(st.selector.unhealthy(role))
    )
    content, content_type = exposition(st.metrics.registry)
    return Response(content, media_type=content_type)
