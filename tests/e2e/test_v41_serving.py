"""DeepSeek-V4.1 through the whole stack, as real processes: `dsaserve up --model` on a tiny V4.1
checkpoint in the release's layout serves the independent reference's greedy tokens through the
prefill/decode path (gRPC, the KV pulled over NIXL: Engram's n-grams at the first decode step
read the prompt's last tokens, which came with the request), a prompt sent again resumed from
the prefill worker's prefix cache, chats rendered by DeepSeek's library as `dsaserve generate
--chat` renders them, images refused; and a prefill/decode pair whose workers export Engram's
lookups and device-cache hits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from dsaserve.engine.models.deepseek_v41.tiny import make_tiny_model
from dsaserve.engine.text.chat_format import ChatOptions, V41Chat
from tests.conftest import free_port
from tests.reference_v41 import ReferenceV41
from tests.serving_stack import (
    START_TIMEOUT_S,
    http_status,
    offline_generate,
    openai_client,
    pd_stack,
    wait_for,
)

pytestmark = pytest.mark.e2e  # the stack's processes

ASCII = list(range(32, 127))  # one byte token a character: a reply's text is its tokens
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Oslo?"},
]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v41") / "tiny", seed=5, fmt="release")


def test_dsaserve_up_serves_a_v41_checkpoint(model: Path, tmp_path: Path) -> None:
    reference = ReferenceV41(model)
    prompts = [ids(n, 200 + n) for n in (7, 64, 150)]
    want = [bytes(reference.greedy(p, 12, ASCII)).decode() for p in prompts]
    offline = offline_generate(model, MESSAGES, 12, "--thinking")
    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "dsaserve.services.cli", "up", "--model", str(model),
         "--port", str(port), "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--api-key", "unused"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert up.poll() is None, log.read_text()[-3000:]
            return http_status(url + "/health") == 200

        wait_for(healthy, START_TIMEOUT_S, "dsaserve up to report healthy")
        with openai_client(url) as c:
            # token ids in, greedy among ASCII: prefilled in chunks of 64, decoded on the other
            # worker
            sampling = {"ignore_eos": True, "allowed_token_ids": ASCII}
            for prompt, text in zip(prompts, want, strict=True):
                res = c.completions.create(
                    model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=sampling
                )
                assert res.choices[0].text == text
            # sent again: resumed from the prefill worker's checkpoint at its end
            again = c.completions.create(
                model="tiny", prompt=prompts[-1], max_tokens=12, temperature=0, extra_body=sampling
            )
            assert again.choices[0].text == want[-1]
            assert again.usage.prompt_tokens_details.cached_tokens == len(prompts[-1]) - 1
            # a chat: DeepSeek's library renders it, as `dsaserve generate --chat` does
            chat = c.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": True}},
            )  # fmt: skip
            message = chat.choices[0].message
            assert (message.content or "") == offline["message"]["content"]
            assert (getattr(message, "reasoning_content", None) or "") == offline["message"].get(
                "reasoning_content", ""
            )
        auth = {"Authorization": "Bearer unused"}
        rendered = httpx.post(
            url + "/tokenize",
            json={"model": "tiny", "messages": MESSAGES, "reasoning_effort": "max"},
            headers=auth,
        ).json()["tokens"]
        text = httpx.post(
            url + "/detokenize", json={"model": "tiny", "tokens": rendered}, headers=auth
        ).json()["prompt"]
        library = V41Chat().render(
            MESSAGES, options=ChatOptions(thinking=True, reasoning_effort="max")
        )
        assert text == library and "Reasoning Effort: 100 " in text
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        refused = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": [image]}]},
            headers=auth,
        )
        assert refused.status_code == 400
        assert "vision tower is not loaded" in refused.json()["error"]["message"]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]


def test_workers_export_engram_lookups_and_cache_hits(
    model: Path, redis_url: str, tmp_path: Path
) -> None:
    with pd_stack(model, redis_url, tmp_path) as s:
        with openai_client(s.url) as c:
            for seed in range(3):
                c.completions.create(model="tiny", prompt=ids(40, seed), max_tokens=4)
        for worker in (s.prefill, s.decode):
            lookups = worker.counter("dsaserve_engram_lookups_total")
            hits = worker.counter("dsaserve_engram_cache_hits_total")
            assert lookups > 0 and 0 <= hits <= lookups, (worker.name, lookups, hits)
