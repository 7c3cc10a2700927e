"""The router under a fuzzer: schemathesis generates requests from the router's own /openapi.json,
some valid and some breaking the schema, and no answer may be a 5xx, a dropped connection, a
status, header or body the schema does not describe, or an invalid request taken as valid.

Real processes (redis-server, a prefill and a decode worker on the tiny model, the router), so
a valid request runs the whole path, streaming included. The router's `--max-model-len 32`
keeps each generation to a few tokens: a few hundred cases take about half a minute.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks
from schemathesis.generation import GenerationMode
from schemathesis.schemas import BaseSchema

from tests.serving_stack import Stack, StackSpec

pytestmark = pytest.mark.e2e  # the router and both workers as processes, fuzzed

EXAMPLES_PER_OPERATION = 150


# (conftest's `stack`) on `tiny`, in a registry of its own
STACK = StackSpec(
    db=3, router_flags=("--max-request-bytes", str(64 << 10), "--max-model-len", "32")
)


@pytest.fixture(scope="module")
def router_api(stack: Stack) -> BaseSchema:
    return schemathesis.openapi.from_url(stack.url + "/openapi.json", wait_for_schema=60)


# Every operation of /openapi.json (a test below holds this list to the schema).
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /live",
    "GET /health",
    "GET /metrics",
]
# Other APIs' shapes over the same chat path (Anthropic's Messages, OpenAI's Responses): fewer
# cases each, the generation behind them being the chat completions' own.
OTHER_APIS = [
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
    "DELETE /v1/responses/{response_id}",
]
EXAMPLES_PER_OTHER_API = 40
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


def test_every_operation_is_fuzzed(router_api: BaseSchema) -> None:
    operations = [op.ok() for op in router_api.get_all_operations()]
    found = sorted(f"{op.method.upper()} {op.path}" for op in operations)
    assert found == sorted(OPERATIONS + OTHER_APIS)


@pytest.mark.parametrize("operation", OPERATIONS)
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same cases on every run: a CI failure reproduces
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_fuzzed_requests_get_described_4xx_answers_never_5xx(
    router_api: BaseSchema, operation: str, data: st.DataObject
) -> None:
    _fuzz(router_api, operation, data)


@pytest.mark.parametrize("operation", OTHER_APIS)
@settings(
    max_examples=EXAMPLES_PER_OTHER_API,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_other_apis_fuzzed_get_described_4xx_answers_never_5xx(
    router_api: BaseSchema, operation: str, data: st.DataObject
) -> None:
    _fuzz(router_api, operation, data)


def _fuzz(router_api: BaseSchema, operation: str, data: st.DataObject) -> None:
    method, path = operation.split()
    # Valid requests, and requests that break the schema (which must be refused with a 4xx).
    mode = data.draw(st.sampled_from(list(GenerationMode)))
    case = data.draw(router_api[path][method].as_strategy(generation_mode=mode))
    case.call_and_validate(checks=CHECKS, timeout=30)
