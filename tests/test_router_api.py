"""The router's HTTP surface without model workers: validation, auth, models, health, metrics.

Real HTTP through uvicorn and a real redis-server; worker records are registered the way
workers do it (WorkerRegistration), pointing at addresses nothing needs to answer on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.load import Load
from services.registry import WorkerRecord, WorkerRegistration
from services.router.settings import RouterSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-router-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

StartRouter = Callable[[RouterSettings], Awaitable[Any]]


@pytest_asyncio.fixture
async def router(start_router: StartRouter, router_model_dir: Path, redis_url: str) -> Any:
    return await start_router(RouterSettings(model_dir=str(router_model_dir), redis_url=redis_url))


@pytest_asyncio.fixture
async def http(router: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        yield client


@pytest_asyncio.fixture
async def registered(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[None]]]:
    """Register worker records in Redis, as a worker process would; all are stopped afterwards."""
    regs: list[WorkerRegistration] = []

    async def register(worker_id: str, role: str, layout: str = "L1") -> None:
        rec = WorkerRecord(worker_id, role, "127.0.0.1:9", MODEL, layout, f"agent-{worker_id}")  # type: ignore[arg-type]
        reg = WorkerRegistration(redis_url, rec, Load)
        await reg.start()
        regs.append(reg)

    yield register
    for reg in regs:
        await reg.stop()


def assert_openai_error(
    response: httpx.Response, status: int, *, param: str | None = None, says: str = ""
) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert says.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    return error["message"]


# ---------------------------------------------------------------- 400: invalid input


@pytest.mark.asyncio
async def test_malformed_json_is_400(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, says="not valid JSON")


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"n": 2}, "n", "n=1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "system"),
        ({"messages": []}, "messages", "at least 1"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "text",
        ),
        ({"temperature": 3.5}, "temperature", "2"),
        ({"max_tokens": 0}, "max_tokens", "1"),
        ({"stream_options": {"include_usage": True}}, None, "stream"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_chat_fields_are_400(
    http: httpx.AsyncClient, patch: dict, param: str | None, says: str
) -> None:
    response = await http.post("/v1/chat/completions", json=CHAT | patch)
    assert_openai_error(response, 400, param=param, says=says)


@pytest.mark.asyncio
async def test_missing_messages_is_400(http: httpx.AsyncClient) -> None:
    assert_openai_error(
        await http.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages"
    )


@pytest.mark.asyncio
async def test_chat_template_refusal_is_400(http: httpx.AsyncClient) -> None:
    # The tiny model's template has no tool role and says so through raise_exception.
    body = CHAT | {"messages": [{"role": "tool", "content": "42"}]}
    assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="messages", says="tool"
    )


@pytest.mark.asyncio
async def test_prompt_over_context_is_400(http: httpx.AsyncClient) -> None:
    body = CHAT | {"messages": [{"role": "user", "content": "x" * 100}]}
    message = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="messages"
    )
    assert (
        "maximum context length is 64 tokens" in message and "103 tokens" in message
    )  # bos, User, 100 x, Assistant

    message = assert_openai_error(
        await http.post("/v1/completions", json={"prompt": list(range(64))}), 400, param="prompt"
    )
    assert "64 tokens" in message


@pytest.mark.asyncio
async def test_prompt_plus_max_tokens_over_context_is_400(http: httpx.AsyncClient) -> None:
    body = CHAT | {"max_completion_tokens": 60}  # the prompt is 5 tokens: 5 + 60 > 64
    message = assert_openai_error(
        await http.post("/v1/chat/completions", json=body), 400, param="max_tokens"
    )
    assert "65 tokens" in message and "at most 59" in message


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([5, 9999], "[0, 262)"),
        (["a", "b"], "one prompt per request"),
        ("", "empty"),
        ([[1, 2], [3]], "one prompt"),
    ],
)
@pytest.mark.asyncio
async def test_invalid_completion_prompts_are_400(
    http: httpx.AsyncClient, prompt: Any, says: str
) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert_openai_error(response, 400, param="prompt", says=says)


# ---------------------------------------------------------------- 401 / 404


@pytest.mark.asyncio
async def test_api_keys(start_router: StartRouter, router_model_dir: Path, redis_url: str) -> None:
    router = await start_router(
        RouterSettings(str(router_model_dir), redis_url, api_keys=("k1", "k2"))
    )
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
        assert_openai_error(await http.post("/v1/chat/completions", json=CHAT), 401, says="API key")
        wrong = {"Authorization": "Bearer nope"}
        assert_openai_error(await http.post("/v1/chat/completions", json=CHAT, headers=wrong), 401)
        assert_openai_error(
            await http.get("/v1/models", headers={"Authorization": "Basic k1"}), 401
        )
        assert (
            await http.get("/v1/models", headers={"Authorization": "Bearer k2"})
        ).status_code == 200
        # A right key gets past authentication (to the 503 of an empty registry).
        right = {"Authorization": "Bearer k1"}
        assert (
            await http.post("/v1/chat/completions", json=CHAT, headers=right)
        ).status_code == 503
        assert (await http.get("/health")).status_code == 503  # probes need no key

    client = router.openai(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()


@pytest.mark.asyncio
async def test_unknown_model_is_404(router: Any) -> None:
    client = router.openai()
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found"
    assert MODEL in info.value.message


@pytest.mark.asyncio
async def test_unknown_route_is_404(http: httpx.AsyncClient) -> None:
    assert_openai_error(await http.get("/v1/engines"), 404, says="unknown route")
    assert_openai_error(await http.get("/v1/chat/completions"), 405)


# ---------------------------------------------------------------- 503, /health, /v1/models


@pytest.mark.asyncio
async def test_no_workers_is_503(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(response, 503, says="no live prefill or decode worker")


@pytest.mark.asyncio
async def test_only_prefill_is_503_naming_decode(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill")
    await router.refresh_registry()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    message = assert_openai_error(response, 503, says="no live decode worker")
    assert "prefill" not in message.split("dsaserve")[0]


@pytest.mark.asyncio
async def test_layout_mismatch_is_503(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill", layout="L1")
    await registered("d1", "decode", layout="L2")
    await router.refresh_registry()
    assert_openai_error(await http.post("/v1/chat/completions", json=CHAT), 503, says="KV layout")
    health = await http.get("/health")
    assert health.status_code == 503 and "KV layout" in health.json()["message"]


@pytest.mark.asyncio
async def test_health_needs_both_roles(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    response = await http.get("/health")
    assert response.status_code == 503
    assert response.json()["workers"] == {"prefill": 0, "decode": 0}
    live = await http.get("/live")  # the process answers whether or not it can serve
    assert live.status_code == 200 and live.json() == {"status": "ok"}

    await registered("d1", "decode")
    await router.refresh_registry()
    response = await http.get("/health")
    assert (
        response.status_code == 503
        and "no live prefill worker" in response.json()["message"].lower()
    )

    await registered("p1", "prefill")
    await router.refresh_registry()
    response = await http.get("/health")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "model": MODEL,
        "workers": {"prefill": 1, "decode": 1},
    }


@pytest.mark.asyncio
async def test_models_lists_the_served_model(
    router: Any, start_router: StartRouter, router_model_dir: Path, redis_url: str
) -> None:
    client = router.openai()
    models = (await client.models.list()).data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 64

    renamed = await start_router(
        RouterSettings(str(router_model_dir), redis_url, served_model_name="deepseek-v4")
    )
    async with httpx.AsyncClient(base_url=renamed.url) as http:
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "deepseek-v4"


# ---------------------------------------------------------------- /metrics


@pytest.mark.asyncio
async def test_metrics_parse_and_count_outcomes(
    router: Any, http: httpx.AsyncClient, registered: Any
) -> None:
    await registered("p1", "prefill")
    await router.refresh_registry()
    await http.post("/v1/chat/completions", json=CHAT | {"n": 3})
    await http.post("/v1/chat/completions", json=CHAT)  # 503: no decode worker

    response = await http.get("/metrics")
    assert response.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    chat = ("endpoint", "/v1/chat/completions")
    assert samples[("dsaserve_router_requests_total", (chat, ("status", "400")))] == 1
    assert samples[("dsaserve_router_requests_total", (chat, ("status", "503")))] == 1
    assert samples[("dsaserve_router_failures_total", (("cause", "no_worker"),))] == 1
    assert samples[("dsaserve_router_live_workers", (("role", "prefill"),))] == 1
    assert samples[("dsaserve_router_live_workers", (("role", "decode"),))] == 0
    assert samples[("dsaserve_router_queue_depth", ())] == 0
    assert samples[("dsaserve_router_inflight_requests", ())] == 0
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert samples[(f"dsaserve_router_{histogram}_count", ())] == 0
    assert samples[("dsaserve_router_prompt_tokens_total", ())] == 0


# ---------------------------------------------------------------- torch-free


def test_router_imports_without_torch() -> None:
    code = (
        "import sys, services.router, services.router.main, services.registry, services.cli\n"
        "from services.cli import build_parser; build_parser('router')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
