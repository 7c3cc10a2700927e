"""A vocabulary larger than the tokenizer (the release's 129280 rows): padded ids are never
sampled and never accepted in a prompt, offline, from the CLI and when served.

The release-format tiny model's head scales its padded rows up, so that their logits win almost
everywhere: an engine that forgot to mask them would sample them at once. The CUDA-graph path
is in test_engine_gpu.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from dsaserve.engine.llm import LLM
from dsaserve.engine.request import RequestError
from dsaserve.engine.sampling_params import SamplingParams
from tests.release_reference import TOKENS
from tests.serving_stack import StackSpec

SAMPLED = SamplingParams(max_tokens=48, temperature=1.0, seed=5, ignore_eos=True)
PROMPT = [256, 72, 105, 33]  # bos "Hi!"

# (conftest's `stack`) router, prefill and decode workers on the release-format model (its default
# precision on the CPU: dequantized)
STACK = StackSpec(model="release")


def test_padded_rows_would_win_without_the_mask(release):
    """The premise of every test here: unmasked, the padded rows hold the argmax."""
    logits = LLM(release).engine.score(PROMPT + list(range(100)))  # (every row of the model)
    assert (logits.argmax(-1) >= TOKENS).float().mean() > 0.9


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}], ids=["dequantized", "quantized"])
def test_offline_generation_never_samples_padded_ids(release, options):
    llm = LLM(release, **options)
    prompts = [PROMPT, list(range(1, 200)), [256]]
    greedy = SamplingParams(max_tokens=48, ignore_eos=True)  # 48 tokens whatever they are
    results = llm.generate(prompts, [SAMPLED, SAMPLED, greedy])
    for res in results:
        assert len(res.token_ids) == 48 and max(res.token_ids) < TOKENS
        assert res.text == llm.tokenizer.decode(res.token_ids)


def test_offline_prompts_with_padded_ids_are_refused(release):
    llm = LLM(release)
    with pytest.raises(RequestError, match=r"prompt token ids must be in \[0, 264\); got \[300\]"):
        llm.generate([256, 300], SAMPLED)
    assert not llm.engine.has_unfinished()


def _cli(model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsaserve.services.cli", "generate", "--model", str(model), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.e2e  # a dsaserve command as a process
def test_cli_generation_never_samples_padded_ids(release):
    out = _cli(
        release,
        "--prompt-token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "48",
        "--temperature",
        "1",
        "--seed",
        "5",
        "--ignore-eos",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(answer["token_ids"]) == 48 and max(answer["token_ids"]) < TOKENS
    # the same draws as the offline API: the CLI is not a path of its own
    [offline] = LLM(release).generate(PROMPT, SAMPLED)
    assert answer["token_ids"] == offline.token_ids


@pytest.mark.e2e  # a dsaserve command as a process
def test_cli_refuses_padded_prompt_ids(release):
    out = _cli(release, "--prompt-token-ids", "256,300,7", "--max-tokens", "4")
    assert out.returncode != 0
    assert "prompt token ids must be in [0, 264); got [300]" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.e2e
def test_served_completions_never_sample_padded_ids(stack, release):
    """Prefill samples token 1, decode the rest, each worker masking its own logits: the text
    equals the offline API's, whose tokens are all below the tokenizer's size."""
    body = {"model": release.name, "prompt": PROMPT, "max_tokens": 48, "temperature": 1.0}
    body |= {"seed": 5, "ignore_eos": True}
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [offline] = LLM(release).generate(PROMPT, SAMPLED)
    assert max(offline.token_ids) < TOKENS
    assert choice["text"] == offline.text and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 48


@pytest.mark.e2e
def test_served_prompts_with_padded_ids_are_refused(stack, release):
    body = {"model": release.name, "prompt": [256, 300], "max_tokens": 4}
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "Token ids must be in [0, 264); got [300]" in r.json()["error"]["message"]
