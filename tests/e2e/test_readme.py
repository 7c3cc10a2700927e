"""The README, walked: `dsaserve up` with the README's own flags and defaults (nothing sized
for tests), and each feature it documents through the openai and anthropic clients: chat and
completions, prefix caching (a prompt sent again, an extension, a conversation's next turn, a
shared prefix) with the decode worker's reuse of what it decoded, speculative decoding,
structured outputs, the Responses and Messages APIs, the agentic benchmark's replay. Answers are
those of the engine without a cache (tokens and logprobs); the workers end idle with every page
back."""

from __future__ import annotations

import argparse
import json

import anthropic
import openai
import pytest

from bench.numerics import BOS, heldout_windows
from dsaserve.engine import models
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import pages_past
from dsaserve.engine.llm import LLM
from loadtest import agentic
from loadtest.up_stack import UpStack
from tests.serving_stack import served_completion, wait_for

DEMO = models.family(DEMO_MODEL_DIR).ModelConfig.from_dir(DEMO_MODEL_DIR)
pytestmark = pytest.mark.e2e  # `dsaserve up`: Redis, two workers and the router as processes

MODEL = DEMO_MODEL_DIR.name
SPEC = '{"method": "mtp", "num_speculative_tokens": 2}'  # the README's flag, verbatim


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with UpStack([], tmp_path_factory.mktemp("up") / "up.log") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(up):
    with openai.OpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def uncached():
    """The engine without a prefix cache: what every answer must be."""
    return LLM(DEMO_MODEL_DIR, enable_prefix_caching=False, max_num_seqs=4)


def _text_ids(n: int, offset: int = 0) -> list[int]:
    """n tokens of held-out Shakespeare after BOS (the demo model's tokens are bytes)."""
    text = b"".join(heldout_windows(8, 1024))[offset:]
    return [BOS, *text[: n - 1]]


def _greedy(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_chat_and_completions(up, client) -> None:
    """`dsaserve up` answers OpenAI chat (whole and streamed) and completions; its workers
    hold as many sequences as half the default budget gives fixed state to, and say so."""
    assert up.log.read_text().count("max_num_seqs lowered from 256 to 116") == 2
    messages = [{"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=16)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")


def test_prefix_caching_as_the_readme_says(up, client, uncached) -> None:
    """A prompt sent again computes one token, an extension only its new tokens, a
    conversation's next turn none of the last one (its answer borrowed from the decode worker
    that kept it, which pulls only the new pages), a prompt sharing L tokens at most 512 of
    them; answers as without the cache; every page back when idle."""
    a = _text_ids(1200)
    assert served_completion(client, a, uncached)[0] == 0
    cached, answer = served_completion(client, a, uncached)
    assert cached == 1199  # sent again
    assert served_completion(client, a + [65], uncached)[0] == 1200  # extended by one token
    # by four, the first of them the one before's: resumed where that prompt ended
    assert served_completion(client, a + [65, 66, 67, 68], uncached)[0] == 1201
    # The next turn: the answer's state (but its last token, sampled and never computed) came
    # from the decode worker that decoded it; that worker shares what it kept and pulls the rest.
    pulled = up.metric("decode", "dsaserve_kv_pulled_pages_total")
    reused = up.metric("decode", "dsaserve_kv_reused_pages_total")
    turn = a + answer + _text_ids(150, 5000)[1:]
    kept = len(a) + len(answer) - 1
    assert served_completion(client, turn, uncached)[0] == kept
    assert up.metric("decode", "dsaserve_kv_pulled_pages_total") - pulled == pages_past(
        DEMO, 64, len(turn), kept // 64 * 64
    )
    assert up.metric("decode", "dsaserve_kv_reused_pages_total") > reused
    # a prompt sharing 900 tokens: from the checkpoint at 512 at least
    assert served_completion(client, a[:900] + _text_ids(40, 7000)[1:], uncached)[0] >= 900 - 512
    wait_for(up.idle, 30, "both workers idle with every page back")


def test_structured_outputs(client) -> None:
    """A json_schema response format: the reply is JSON of the schema (bounded strings: the
    demo model never closes a free one)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "alive": {"type": "boolean"}},
        "required": ["name", "alive"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who speaks first?"}],
        max_tokens=200,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "speaker", "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"name", "alive"} and isinstance(answer["alive"], bool)


def test_responses_and_messages(up, client) -> None:
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8)
    assert first.status in ("completed", "incomplete") and first.output_text  # (max tokens)
    follow = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=8
    )
    assert follow.output_text and client.responses.retrieve(follow.id).id == follow.id
    with anthropic.Anthropic(base_url=up.url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.content[0].type == "text" and message.stop_reason in (
            "end_turn",
            "max_tokens",
        )


def test_speculative_decoding_keeps_the_greedy_tokens(up, client, tmp_path_factory) -> None:
    """`dsaserve up --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'`
    starts with every other default and answers greedy requests with the plain stack's
    tokens; the decode worker's metrics count the accepted drafts (vLLM's)."""
    prompts = [[BOS, *w[:64]] for w in heldout_windows(6)]
    want = [_greedy(client, p, 48) for p in prompts]
    with UpStack(["--speculative-config", SPEC], tmp_path_factory.mktemp("spec") / "up.log") as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) as spec:
            assert [_greedy(spec, p, 48) for p in prompts] == want
        assert s.log.read_text().count("max_num_seqs lowered from 256 to 71") == 2
        drafts = s.metric("decode", "dsaserve_spec_decode_num_drafts_total")
        accepted = s.metric("decode", "dsaserve_spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 1 + accepted / drafts > 1.5
        wait_for(s.idle, 30, "both workers idle with every page back")


def test_the_agentic_benchmark_reads_from_the_cache_all_it_can(up) -> None:
    """`loadtest/agentic.py`'s replay on this stack (a small trace): after a conversation's
    first turn every turn reads from the cache all an earlier request computed, and no turn
    pulls more than its new pages and one."""
    args = argparse.Namespace(
        conversations=2, turns=3, system=200, task=20, answer=8, result=40, seed=0
    )
    turns = agentic.replay(up, args)
    assert all(t["cached_tokens"] == t["best_cached_tokens"] for t in turns if t["turn"])
    assert agentic.summarize(turns)["turns_pulling_more_than_new_pages_plus_one"] == 0
    wait_for(up.idle, 30, "both workers idle with every page back")
