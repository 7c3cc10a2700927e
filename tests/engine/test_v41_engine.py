"""DeepSeek-V4.1 in the engine's machinery: its pools (the layers with a window only, each ratio's
KV sources with their entries and index keys), a prefilled request moved to another engine (as a
PD handoff moves it: the tokens come with the request, so Engram's n-grams at the first decode
step read the prompt's last tokens), preemption under a small KV budget and synchronous steps
against the independent reference; what V4.1 does not serve refused at start. (Two
tensor-parallel ranks: test_tensor_parallel.py; engines sharing the experts:
test_data_parallel.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.kv.layout import SLAB
from dsaserve.engine.llm import LLM
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v41.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from tests.engine_cases import check_moved_request_decodes_as_if_never_moved
from tests.reference_v41 import ReferenceV41

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=37, page_size=8, kv_cache_memory_bytes=32 << 20)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v41_engine"), seed=4)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> ReferenceV41:
    return ReferenceV41(tiny)


def test_pools_keep_windows_apart_from_the_sources_entries(tiny: Path) -> None:
    llm = LLM(tiny, **ENGINE)
    pool, cfg = llm.engine.pool, llm.engine.model_config
    assert {g: (p.layers, p.ratio) for g, p in pool.groups.items()} == {
        "swa": ((0, 2, 5, 6, 7), 0),
        "comp2": ((1, 3), 2),
        "comp1": ((4,), 1),
    }
    assert all(set(p.index_k) == set(p.layers) for g, p in pool.groups.items() if p.ratio)
    # a ratio-2 source keeps its last two positions' raw projections; ratio 1 nothing
    assert set(pool.comp_ring) == {1, 3} and pool.comp_ring[1][0].shape[1:] == (2, cfg.head_dim)
    assert pool.layout()["family"] == "deepseek_v41"


@pytest.mark.parametrize("via", ["staging", "pages"])
def test_a_prefilled_request_decodes_on_another_engine_as_if_never_moved(
    tiny: Path, reference: ReferenceV41, via: str
) -> None:
    prompt = ids(53, 5)
    config = EngineConfig(**ENGINE)
    got = check_moved_request_decodes_as_if_never_moved(
        tiny, config, prompt, via, {"swa", "comp2", "comp1", SLAB}
    )
    assert got == reference.greedy(prompt, 6)


def test_preempted_requests_recompute_to_the_same_tokens(tiny: Path, reference: ReferenceV41):
    """A budget that holds a few of the requests at once: the scheduler preempts and the
    recomputed prefills (prompt and generated tokens, anchored at their end) decode on."""
    prompts = [ids(n, 40 + n) for n in (60, 45, 70, 33, 52, 66)]
    longer = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    small = {**ENGINE, "kv_cache_memory_bytes": 300 << 10, "max_num_seqs": 4}
    llm = LLM(tiny, **small, enable_prefix_caching=False)  # (168 tokens a group)
    got = [r.token_ids for r in llm.generate(prompts, longer)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == [reference.greedy(p, longer.max_tokens) for p in prompts]


def test_synchronous_steps_decode_the_same_tokens(tiny: Path, reference: ReferenceV41) -> None:
    prompts = [ids(n, 60 + n) for n in (3, 38, 81)]
    llm = LLM(tiny, **ENGINE, async_scheduling=False)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == [
        reference.greedy(p, GREEDY.max_tokens) for p in prompts
    ]


@pytest.mark.parametrize(
    ("option", "error", "message"),
    [
        *(
            (
                {"speculative_config": {"method": method, "num_speculative_tokens": 1}},
                ConfigError,
                "the deepseek_v41 family's draft head is not run here",
            )
            for method in ("mtp", "dspark")
        ),
        (
            {"kv_cache_dtype": "fp8"},
            ValueError,
            "--kv-cache-dtype fp8 is not served for deepseek_v41",
        ),
    ],
)
def test_what_is_not_served_is_refused_at_start(tiny: Path, option, error, message) -> None:
    """The DSpark head (no MTP layer to draft with) and V4.1's own KV formats are not served:
    asking for them fails at start, saying so, rather than serving something else."""
    with pytest.raises(error, match=message):
        LLM(tiny, **ENGINE, **option)
