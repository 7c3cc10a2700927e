"""Speculative decoding under disaggregation: a prefill worker that runs the MTP layer over the
prompt and drafts after the first token, and a decode worker that verifies those drafts at its
first step and drafts on, both with --speculative-config, through the router."""

from __future__ import annotations

import pytest

from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.llm import LLM
from dsaserve.engine.sampling_params import SamplingParams
from tests.serving_stack import StackSpec, openai_client, wait_all_kv_free

pytestmark = pytest.mark.e2e  # the router and both workers as processes

SPEC = '{"method": "mtp", "num_speculative_tokens": 2}'
PROMPTS = ["ROMEO:\nWhat light through yonder", "KING HENRY:\nOnce more unto the"]
# (conftest's `stack`) both workers speculate
STACK = StackSpec(
    model=DEMO_MODEL_DIR, worker_flags=("--speculative-config", SPEC, "--max-num-seqs", "4")
)


def test_greedy_completions_equal_offline_ones_and_aborts_free_both_workers(stack):
    """Greedy text through prefill + decode workers that speculate equals the offline engine's
    without speculation; a stream closed while drafts are in flight frees every page on both
    workers; the decode worker counts its drafts in vLLM's metrics."""
    offline = LLM(DEMO_MODEL_DIR, max_num_seqs=4).generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0)
    )
    client = openai_client(stack.url)
    for prompt, want in zip(PROMPTS, offline, strict=True):
        res = client.completions.create(
            model=DEMO_MODEL_DIR.name, prompt=prompt, max_tokens=24, temperature=0
        )
        assert res.choices[0].text == want.text
        assert res.choices[0].finish_reason == want.finish_reason
    accepted = stack.decode.counter("dsaserve_spec_decode_num_accepted_tokens_total", role="decode")
    drafts = stack.decode.counter("dsaserve_spec_decode_num_drafts_total", role="decode")
    assert drafts > 0 and accepted > 0
    # three tokens: the prefill worker's first, then one draft (the most the third token
    # leaves), which only the decode worker's first step can verify: it came with the KV
    client.completions.create(
        model=DEMO_MODEL_DIR.name, prompt=PROMPTS[1], max_tokens=3, temperature=0
    )
    assert stack.decode.counter("dsaserve_spec_decode_num_drafts_total", role="decode") == (
        drafts + 1
    )
    stream = client.completions.create(
        model=DEMO_MODEL_DIR.name, prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_all_kv_free(stack.prefill, stack.decode)
