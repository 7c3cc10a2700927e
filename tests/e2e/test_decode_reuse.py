"""Decode-side reuse through the stack (one prefill worker, decode workers, the router, real
Redis, NIXL, gRPC and HTTP): a conversation's next turn goes to the decode worker that decoded
the last one, the prefill worker borrows the last answer's state from it and computes only the
new tokens, and that decode worker pulls only the pages it lacks. A decode worker that lost the
conversation (its cache evicted it, or another worker takes it: the one that had it left)
lends nothing and pulls everything; every answer is the one of an engine without a cache."""

from __future__ import annotations

import httpx
import pytest

from bench.numerics import BOS, heldout_windows
from dsaserve.engine import models
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.kv.layout import checkpoint_bytes, pages_past
from dsaserve.engine.llm import LLM
from tests.serving_stack import (
    Proc,
    Stack,
    openai_client,
    served_completion,
    wait_all_kv_free,
    wait_for,
)

DEMO = models.family(DEMO_MODEL_DIR).ModelConfig.from_dir(DEMO_MODEL_DIR)
pytestmark = pytest.mark.e2e  # the router and three workers as processes

SMALL = ("--max-num-seqs", "8")


def _text(n: int, offset: int) -> list[int]:
    return list(b"".join(heldout_windows(8, 1024))[offset : offset + n])


def test_a_conversation_pulls_its_new_pages_and_a_worker_that_lost_it_everything(
    redis_server, tmp_path
) -> None:
    one = checkpoint_bytes(DEMO, 64, 4)  # (fp32 pages: a decode worker keeping one conversation)
    uncached = LLM(DEMO_MODEL_DIR, enable_prefix_caching=False, max_num_seqs=4)
    s = Stack(DEMO_MODEL_DIR, redis_server, tmp_path)
    try:
        prefill = s.worker("prefill", *SMALL)
        first = s.worker("decode", *SMALL, "--prefix-cache-checkpoint-memory-bytes", str(one))
        router = s.router()
        s.wait_ready(prefill, first)
        url = s.wait_healthy(router)
        client = openai_client(url)
        conversation, kept = [BOS, *_text(500, 0)], 0

        def turn(decode: Proc, reused: bool) -> None:
            """The conversation's next turn on `decode`: computed from the last answer and
            pulling only its new pages when that worker kept it (`reused`), else from the last
            prompt and pulling every page; then the next turn's prompt."""
            nonlocal conversation, kept
            pulled = decode.counter("dsaserve_kv_pulled_pages_total")
            cached, answer = served_completion(client, conversation, uncached, max_tokens=24)
            held = kept // 64 * 64 if reused else 0
            assert decode.counter("dsaserve_kv_pulled_pages_total") - pulled == pages_past(
                DEMO, 64, len(conversation), held
            )
            if reused:
                assert cached == kept
            kept = len(conversation) + len(answer) - 1
            conversation = conversation + answer + _text(120, len(conversation))

        turn(first, reused=False)
        turn(first, reused=True)
        # another conversation ends on the only decode worker, which keeps one: ours is evicted
        served_completion(client, [BOS, *_text(300, 4000)], uncached, max_tokens=24)
        turn(first, reused=False)
        # a second decode worker: the next turn still goes to the one holding the conversation
        second = s.worker("decode", *SMALL)
        s.wait_ready(second)
        wait_for(lambda: _decode_workers(url) == 2, 30, "the router to see the new worker")
        untouched = second.counter("dsaserve_kv_pulled_pages_total")
        turn(first, reused=True)
        assert second.counter("dsaserve_kv_pulled_pages_total") == untouched
        # the worker that had the conversation leaves: the other one takes it, from scratch
        first.proc.terminate()  # (a clean stop leaves the registry at once)
        first.proc.wait(timeout=30)
        s.procs.remove(first)
        wait_for(lambda: _decode_workers(url) == 1, 30, "the router to see it gone")
        turn(second, reused=False)
        turn(second, reused=True)
        wait_all_kv_free(prefill, second)
    finally:
        s.stop()


def _decode_workers(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=10).json()["workers"]["decode"])
