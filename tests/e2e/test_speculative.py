"""Speculative decoding under disaggregation, with either draft head: a prefill worker that
computes the head's state over the prompt (MTP: its pass; DSpark: the context every step writes)
and drafts after the first token, and a decode worker that verifies those drafts at its first
step and drafts on, both with --speculative-config, through the router; and `dsaserve up`
serving the DSpark demo model at every gamma."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dsaserve.engine.demo_model import DEMO_DSPARK_MODEL_DIR, DEMO_MODEL_DIR
from dsaserve.engine.llm import LLM
from dsaserve.engine.ports import free_port
from dsaserve.engine.sampling_params import SamplingParams
from tests.serving_stack import (
    START_TIMEOUT_S,
    StackSpec,
    http_status,
    openai_client,
    serving,
    wait_all_kv_free,
    wait_for,
)

pytestmark = pytest.mark.e2e  # the router and both workers as processes

# each head: its checkpoint and flag
HEADS = {
    "mtp": (DEMO_MODEL_DIR, '{"method": "mtp", "num_speculative_tokens": 2}'),
    "dspark": (DEMO_DSPARK_MODEL_DIR, '{"method": "dspark", "num_speculative_tokens": 5}'),
}
PROMPTS = ["ROMEO:\nWhat light through yonder", "KING HENRY:\nOnce more unto the"]


@pytest.fixture(scope="module")
def offline() -> list:
    """Greedy completions without speculation (both demo checkpoints share the main model)."""
    return LLM(DEMO_MODEL_DIR, max_num_seqs=4).generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0)
    )


@pytest.fixture(scope="module", params=list(HEADS))
def head_stack(request, redis_server, tmp_path_factory):
    """A prefill and a decode worker that speculate with one head, and the router."""
    model, spec = HEADS[request.param]
    flags = ("--speculative-config", spec, "--max-num-seqs", "4")
    stack = StackSpec(model=model, worker_flags=flags)
    with serving(stack, model, redis_server, tmp_path_factory.mktemp("spec")) as s:
        s.model = model
        yield s


def test_greedy_completions_equal_offline_ones_and_aborts_free_both_workers(head_stack, offline):
    """Greedy text through prefill + decode workers that speculate equals the offline engine's
    without speculation; a stream closed while drafts are in flight frees every page on both
    workers; the decode worker counts its drafts in vLLM's metrics, per position too."""
    stack = head_stack
    client = openai_client(stack.url)
    for prompt, want in zip(PROMPTS, offline, strict=True):
        res = client.completions.create(
            model=stack.model.name, prompt=prompt, max_tokens=24, temperature=0
        )
        assert res.choices[0].text == want.text
        assert res.choices[0].finish_reason == want.finish_reason
    accepted = stack.decode.counter("dsaserve_spec_decode_num_accepted_tokens_total", role="decode")
    drafts = stack.decode.counter("dsaserve_spec_decode_num_drafts_total", role="decode")
    assert drafts > 0 and accepted > 0
    first = stack.decode.counter(
        "dsaserve_spec_decode_num_draft_tokens_per_pos_total", role="decode", position="0"
    )
    assert first == drafts  # (every verification verifies its first draft)
    # three tokens: the prefill worker's first, then one draft (the most the third token
    # leaves), which only the decode worker's first step can verify: it came with the KV
    client.completions.create(
        model=stack.model.name, prompt=PROMPTS[1], max_tokens=3, temperature=0
    )
    assert stack.decode.counter("dsaserve_spec_decode_num_drafts_total", role="decode") == (
        drafts + 1
    )
    stream = client.completions.create(
        model=stack.model.name, prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_all_kv_free(stack.prefill, stack.decode)


@pytest.mark.parametrize("gamma", [1, 5])
def test_dsaserve_up_serves_dspark_with_the_tokens_of_no_speculation(gamma, offline, tmp_path):
    """`dsaserve up --model <the DSpark demo> --speculative-config dspark`: its prefill and decode
    workers draft and verify blocks of gamma; greedy answers are those without speculation.
    (The smallest and largest block through the served path; every gamma in between is the
    engine's test_greedy_tokens_equal_those_without_speculation.)"""
    port = free_port()
    log = tmp_path / "up.log"
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": gamma})
    up = subprocess.Popen(
        [sys.executable, "-m", "dsaserve.services.cli", "up", "--model",
         str(DEMO_DSPARK_MODEL_DIR), "--port", str(port), "--speculative-config", spec,
         "--max-num-seqs", "4"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert up.poll() is None, log.read_text()[-3000:]
            return http_status(url + "/health") == 200

        wait_for(healthy, START_TIMEOUT_S, "dsaserve up to report healthy")
        with openai_client(url) as client:
            for prompt, want in zip(PROMPTS, offline, strict=True):
                res = client.completions.create(
                    model=DEMO_DSPARK_MODEL_DIR.name, prompt=prompt, max_tokens=24,
                    temperature=0,
                )  # fmt: skip
                assert res.choices[0].text == want.text
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
