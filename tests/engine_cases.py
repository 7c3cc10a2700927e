"""What the engine tests share: prompts, running an engine dry, and checking it holds nothing."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.request import RequestOutput

PROMPTS = [
    "The quick brown fox",
    "a",
    "0123456789" * 9,
    "Once upon a time, in a land far away,",
    "zz" * 30,
]


def drain(engine: LLMEngine, limit: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished (in-flight steps included); each request's outputs.
    Fails if a request gets an output after its finishing one."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            assert not any(o.finished for o in outputs.get(out.request_id, [])), (
                f"{out.request_id} got an output after its last"
            )
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def assert_all_free(engine: LLMEngine) -> None:
    """Every page and slab row free, no request left anywhere."""
    load = engine.load()
    assert load.free_pages == load.total_pages == engine.pool.num_total_pages
    assert load.running == load.waiting == 0
    assert engine.pool.slab.num_free == engine.config.max_num_seqs
    assert not engine.scheduler.requests
