"""The clients people point at an OpenAI-compatible server, against one real stack (router,
prefill and decode workers as processes, the tiny release-format DeepSeek-V4): lm-evaluation-
harness's `local-completions` (loglikelihoods through `echo` and prompt logprobs, checked
against `LLM.score`), vLLM's completion extensions (batched prompts, `max_tokens: 0`,
`prompt_logprobs`) and `continuous_usage_stats`. Every request must leave the workers' KV free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from dsaserve.engine.llm import LLM
from tests.serving_stack import StackSpec, wait_all_kv_free

pytestmark = pytest.mark.e2e  # the router and both workers as processes

STACK = StackSpec(model="release", db=5)  # (conftest's `stack`) in a registry of its own

# A multiple-choice task of lm-eval's own kind, read from a local file.
QUESTIONS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " Rome", " a river"],
        "answer": 0,
    },
    {"question": "Two plus two makes", "choices": [" four", " five"], "answer": 0},
]


@pytest.fixture(scope="module")
def llm(release: Path) -> LLM:
    return LLM(release)


def _completion(stack, body: dict) -> dict:
    response = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of LLM.score's rows: [len(ids), vocab] in float64."""
    return torch.log_softmax(llm.score(ids).double(), dim=-1)


def test_lm_eval_loglikelihoods_equal_the_engines_score(
    stack, release, llm, tmp_path, monkeypatch
) -> None:
    """lm-eval's local-completions sends `echo: true, logprobs: 1, max_tokens: 1` with batched
    token-id prompts; each continuation's loglikelihood must be what one causal forward (fp32,
    the tokenizer's vocabulary) gives the same tokens."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # (the task's data is a local file)
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    task = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    }
    (tmp_path / "tiny_mc.yaml").write_text(json.dumps(task))
    lm = get_model("local-completions")(
        model=release.name,
        base_url=stack.url + "/v1/completions",
        tokenizer_backend="huggingface",
        tokenizer=str(release),
        batch_size=4,  # several prompts per request
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), [(loglikelihood, _)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ctx, cont = lm._encode_pair(context, continuation)
            rows = _prompt_logprobs(llm, ctx + cont)
            expected = sum(rows[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3)
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    wait_all_kv_free(stack.prefill, stack.decode)


def test_vllm_completion_extensions(stack, release, llm, client) -> None:
    """Batched prompts (texts and token ids; one choice per prompt and n, prompt-major),
    `max_tokens: 0` with `echo`, `prompt_logprobs` on completions and chats, and
    `continuous_usage_stats` through the openai client: the numbers are the engine's own."""
    texts = ["It was the best", "of times"]
    ids = [llm.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    body = {"model": release.name, "prompt": texts, "n": 2, "max_tokens": 3, "temperature": 0}
    batched = _completion(stack, body)
    assert [c["index"] for c in batched["choices"]] == [0, 1, 2, 3]
    assert batched["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    by_ids = _completion(stack, body | {"prompt": ids})
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in batched["choices"]]

    echoed = _completion(
        stack,
        {"model": release.name, "prompt": texts[0], "max_tokens": 0, "echo": True, "logprobs": 2}
        | {"prompt_logprobs": 1},
    )["choices"][0]
    assert (echoed["text"], echoed["finish_reason"]) == (texts[0], "length")
    rows = _prompt_logprobs(llm, ids[0])
    logprobs = echoed["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(ids[0])
    for j, (lp, top) in enumerate(
        zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True)
    ):
        assert lp == pytest.approx(rows[j, ids[0][j + 1]].item(), abs=1e-4)
        assert len(top) in (2, 3)  # the two likeliest and the token itself
    vllm = echoed["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids[0])
    for j, entry in enumerate(vllm[1:]):
        token = entry[str(ids[0][j + 1])]
        assert token["logprob"] == pytest.approx(rows[j, ids[0][j + 1]].item(), abs=1e-4)

    chat = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        | {"prompt_logprobs": 0},
        timeout=60,
    ).json()
    tokens = httpx.post(
        stack.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()["tokens"]
    assert len(chat["prompt_logprobs"]) == len(tokens) and chat["prompt_logprobs"][0] is None

    stream = client.chat.completions.create(
        model=release.name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    usages = [chunk.usage for chunk in stream]
    assert all(u is not None and u.prompt_tokens == len(tokens) for u in usages)
    assert usages[-1].completion_tokens == 4
    wait_all_kv_free(stack.prefill, stack.decode)


WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_anthropic_sdk_messages(stack, release) -> None:
    """The anthropic SDK's messages.create, whole and streamed, with a tool and thinking, on
    real workers: well-formed messages, usage that adds up, and the KV freed."""
    import anthropic

    with anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0) as client:
        request = {
            "model": release.name,
            "max_tokens": 6,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Weather in Lima?"}],
            "tools": [WEATHER],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        message = client.messages.create(**request)
        assert message.content and message.content[0].type == "thinking"
        assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
        assert message.usage.output_tokens <= 6
        with client.messages.stream(**request) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        # (the second time the prompt comes from the prefix cache)
        total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
        assert total == message.usage.input_tokens + message.usage.cache_read_input_tokens
    wait_all_kv_free(stack.prefill, stack.decode)


def test_openai_responses(stack, release) -> None:
    """responses.create whole, streamed and continued by previous_response_id, on real workers.
    (The Agents SDK's tool loop runs against scripted workers,
    tests/services/test_router_responses.py: it treats a reply cut by max_output_tokens as an
    error, and this random-weight model ends none by itself.)"""
    import openai

    with openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0) as client:
        first = client.responses.create(model=release.name, input="Hi", max_output_tokens=4)
        assert first.status in ("completed", "incomplete") and first.output
        again = client.responses.create(
            model=release.name, input="And?", previous_response_id=first.id, max_output_tokens=4
        )
        assert again.usage.input_tokens > first.usage.input_tokens
        with client.responses.stream(model=release.name, input="Hi", max_output_tokens=4) as s:
            kinds = [event.type for event in s]
        assert kinds[0] == "response.created" and kinds[-1] in (
            "response.completed",
            "response.incomplete",
        )
    wait_all_kv_free(stack.prefill, stack.decode)


IF_SCHEMA = {"type": "object", "if": {"required": ["a"]}, "then": {}}


class Forecast(BaseModel):
    """A structured reply random weights finish: every value one of a few, the JSON compact
    (enums, not numeric bounds: anthropic's SDK moves those out of the schema it sends)."""

    model_config = ConfigDict(extra="forbid")
    sky: Literal["sun", "rain", "snow"]
    days: Literal[1, 2, 3]
    warm: bool


def test_openai_responses_structured_output(stack, release) -> None:
    """responses.parse(text_format=...) and text.format json_schema (strict), whole and
    streamed, and after the reasoning in thinking mode: valid JSON of the schema on random
    weights, the reasoning's tokens counted in usage."""
    import openai

    with openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0) as client:
        parsed = client.responses.parse(
            model=release.name, input="Forecast?", text_format=Forecast, max_output_tokens=64
        )
        assert isinstance(parsed.output_parsed, Forecast), parsed.output_text
        assert parsed.usage.output_tokens_details.reasoning_tokens == 0
        schema = {"type": "json_schema", "name": "forecast", "strict": True}
        schema["schema"] = Forecast.model_json_schema()
        thought = client.responses.create(
            model=release.name,
            input="Forecast?",
            text={"format": schema},
            reasoning={"effort": "high"},
            max_output_tokens=64,
            extra_body={"thinking_token_budget": 5},
        )
        assert [item.type for item in thought.output][:2] == ["reasoning", "message"]
        Forecast.model_validate_json(thought.output_text)
        reasoning = thought.usage.output_tokens_details.reasoning_tokens
        assert 1 <= reasoning <= 6 < thought.usage.output_tokens  # (5 tokens and </think>)
        with client.responses.stream(
            model=release.name, input="Forecast?", text_format=Forecast, max_output_tokens=64
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert Forecast.model_validate_json("".join(deltas)) == final.output_parsed
        loose = client.responses.create(
            model=release.name,
            input="JSON?",
            text={"format": {"type": "json_object"}},
            max_output_tokens=24,
        )
        assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(
                model=release.name,
                input="Hi",
                text={"format": {**schema, "schema": IF_SCHEMA}},  # (a keyword it lacks)
            )
        assert bad.value.body["param"].startswith("text.format")
    wait_all_kv_free(stack.prefill, stack.decode)


def test_anthropic_sdk_count_tokens_structured_output_and_stop_sequences(stack, release) -> None:
    """messages.count_tokens counts what the same request's usage reports as its input,
    messages.parse(output_format=...) returns a valid object, a reply ended by a stop sequence
    says so and names it, and an error on the new route comes in Anthropic's shape."""
    import anthropic

    with anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0) as client:
        prompt = {
            "model": release.name,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Weather in Lima?"}],
            "tools": [WEATHER],
        }
        counted = client.messages.count_tokens(**prompt).input_tokens
        message = client.messages.create(**prompt, max_tokens=2)
        assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
        thinking = {"type": "enabled", "budget_tokens": 1024}
        counted = client.messages.count_tokens(**prompt, thinking=thinking).input_tokens
        message = client.messages.create(**prompt, thinking=thinking, max_tokens=2)
        assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens

        parsed = client.messages.parse(
            model=release.name,
            max_tokens=64,
            messages=[{"role": "user", "content": "Forecast?"}],
            output_format=Forecast,
        )
        assert isinstance(parsed.parsed_output, Forecast), parsed.content

        plain = {"model": release.name, "messages": [{"role": "user", "content": "Hi"}]}
        plain["extra_body"] = {"temperature": 0}  # (this SDK no longer sends it by name)
        free = client.messages.create(**plain, max_tokens=16)
        text = "".join(b.text for b in free.content if b.type == "text")
        assert free.stop_reason == "max_tokens" and len(text) >= 4
        stop = text[2:4]  # (greedy: the same reply again, until this)
        ended = client.messages.create(**plain, max_tokens=16, stop_sequences=[stop])
        assert (ended.stop_reason, ended.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in ended.content) == text[: text.index(stop)]
        with client.messages.stream(**plain, max_tokens=16, stop_sequences=[stop]) as stream:
            streamed = stream.get_final_message()
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)

        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.count_tokens(model=release.name, messages=[])
        assert bad.value.body["type"] == "error"
        assert bad.value.body["error"]["type"] == "invalid_request_error"
    wait_all_kv_free(stack.prefill, stack.decode)


def test_vllm_sampling_extensions_through_the_stack(stack, release, llm, client) -> None:
    """min_tokens with ignore_eos false never ends before it; logit_bias, the penalties,
    bad_words and allowed_token_ids change the answer as the engine computes it offline;
    vLLM's stop_reason names a stop token."""
    from dsaserve.engine.sampling_params import SamplingParams

    eos = min(llm.tokenizer.eos_token_ids)
    messages = [{"role": "user", "content": "Hi"}]
    forced = {"logit_bias": {str(eos): 100}, "temperature": 0, "max_tokens": 12}
    early = client.chat.completions.create(model=release.name, messages=messages, extra_body=forced)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    late = client.chat.completions.create(
        model=release.name, messages=messages, extra_body=forced | {"min_tokens": 5}
    )
    assert late.usage.completion_tokens == 6 and late.choices[0].finish_reason == "stop"
    prompt = llm.tokenizer.encode("It was the best", add_special_tokens=True)
    for extra in (
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.8, "min_p": 0.1},
        {"allowed_token_ids": [prompt[1], prompt[2]], "bad_words": ["zz"]},
        {"logit_bias": {str(prompt[-1]): 50}, "stop_token_ids": [prompt[-1]], "min_tokens": 2},
    ):
        body = {"model": release.name, "prompt": prompt, "max_tokens": 8, "temperature": 0} | extra
        got = _completion(stack, body)["choices"][0]
        params = SamplingParams(
            max_tokens=8,
            temperature=0,
            **{
                k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
                for k, v in extra.items()
            },
        )
        [want] = llm.generate([prompt], params)
        assert got["text"] == want.text, extra
        if "stop_token_ids" in extra:
            assert got["stop_reason"] == prompt[-1] and got["finish_reason"] == "stop"
    wait_all_kv_free(stack.prefill, stack.decode)


def test_agents_sdk_output_type_on_its_default_model(stack, release) -> None:
    """The OpenAI Agents SDK's `output_type=` on its default (Responses) model: the SDK asks
    for strict structured output and parses the final output into the type."""
    import asyncio

    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # (traces would go to OpenAI's servers)

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        agent = Agent(
            name="forecaster",
            instructions="Give the forecast.",
            model=OpenAIResponsesModel(model=release.name, openai_client=client),
            model_settings=ModelSettings(max_tokens=64),
            output_type=Forecast,
        )
        result = await Runner.run(agent, "Forecast for Lima?")
        await client.close()
        return result.final_output

    assert isinstance(asyncio.run(run()), Forecast)
    wait_all_kv_free(stack.prefill, stack.decode)


def test_pydantic_ai_native_output_on_the_responses_model(stack, release) -> None:
    """pydantic-ai's OpenAIResponsesModel with NativeOutput: the model's own structured output
    (text.format json_schema), validated into the type."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=stack.url + "/v1", api_key="none")
    agent = Agent(
        OpenAIResponsesModel(release.name, provider=provider),
        output_type=NativeOutput(Forecast),
        model_settings={"max_tokens": 64},
    )
    assert isinstance(agent.run_sync("Forecast for Lima?").output, Forecast)
    wait_all_kv_free(stack.prefill, stack.decode)
