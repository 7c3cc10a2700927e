"""The engine thread's output stream (engine/engine_loop.py) with a real engine on the CPU: a
stream interval of N merges a request's outputs into messages of N new tokens (the last may
carry fewer) with the same tokens, text and logprobs as one message per token."""

from __future__ import annotations

import pytest

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.engine_loop import EngineLoop, OutputQueue
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.request import RequestOutput
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import byte_ids

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


async def _stream(loop: EngineLoop, rid: str, interval: int) -> list[RequestOutput]:
    outputs = OutputQueue()
    await loop.run(loop.engine.add_request, rid, byte_ids(20, 1), PARAMS, listener=outputs)
    return [out async for out in loop.stream(rid, outputs, interval)]


@pytest.mark.asyncio
async def test_a_stream_interval_merges_outputs_without_changing_them(tiny):
    loop = EngineLoop(
        LLMEngine(
            tiny,
            EngineConfig(
                kv_cache_memory_bytes=64 << 20,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                enable_prefix_caching=False,  # both prompts computed alike: equal logprobs
            ),
        )
    )
    loop.start()
    try:
        each = await _stream(loop, "each", 1)
        merged = await _stream(loop, "merged", 3)
    finally:
        loop.stop()
    assert [len(out.new_token_ids) for out in each] == [1] * 8
    assert [len(out.new_token_ids) for out in merged] == [3, 3, 2]
    assert [out.finished for out in merged] == [False, False, True]
    for field in ("new_token_ids", "logprobs"):
        assert [x for out in merged for x in getattr(out, field)] == [
            x for out in each for x in getattr(out, field)
        ]
    assert "".join(out.text for out in merged) == "".join(out.text for out in each)
    last = merged[-1]
    assert (last.finish_reason, last.completion_tokens) == (each[-1].finish_reason, 8)
