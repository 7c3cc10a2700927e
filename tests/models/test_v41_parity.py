"""The engine's DeepSeek-V4.1 against an independent forward written from DeepSeek's own inference
code (tests/reference_v41.py), in fp32, on random tiny checkpoints (engine.models.deepseek_v41
.tiny): every row's logits, greedy tokens of a batch of mixed prompts, chunked prefill with and
without the prefix cache, the decoder layers trimmed to their halo, the release's layout
(dequantized at load), and its quantized compute against the release's `linear()`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.compare import rel_err
from dsaserve.engine.llm import LLM
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v41.block import Block
from dsaserve.engine.models.deepseek_v41.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from tests.reference_v41 import ReferenceV41
from tests.release_reference import assert_layers_compute_the_release, read_checkpoint

pytestmark = pytest.mark.e2e  # the whole model against the reference forward

POOL = dict(max_num_batched_tokens=512, page_size=8, kv_cache_memory_bytes=64 << 20)
LENGTHS = (1, 9, 40, 77, 130)  # shorter and far longer than the window, top-k and halos
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v41"), seed=1)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> ReferenceV41:
    return ReferenceV41(tiny)


@pytest.fixture(scope="module")
def prompts_and_greedy(reference: ReferenceV41) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [ids(n, 100 + n) for n in LENGTHS]
    return prompts, [reference.greedy(p, GREEDY.max_tokens) for p in prompts]


def test_every_rows_logits_match_the_reference(tiny: Path, reference: ReferenceV41) -> None:
    token_ids = ids(150, 7)
    llm = LLM(tiny, **POOL)
    err = rel_err(llm.score(token_ids), reference.logits(token_ids))
    assert err < 1e-4, err


def test_chunked_scoring_matches_the_reference(tiny: Path, reference: ReferenceV41) -> None:
    """Chunks of 37 rows: a pair of a ratio-2 source split between steps, later chunks' queries
    picking among entries and candidate blocks earlier steps wrote, Engram's n-grams reaching
    into the chunk before."""
    token_ids = ids(150, 8)
    llm = LLM(tiny, **{**POOL, "max_num_batched_tokens": 37})
    err = rel_err(llm.score(token_ids), reference.logits(token_ids))
    assert err < 1e-4, err


@pytest.mark.parametrize("chunk", [512, 37, 8])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_batched_greedy_matches_the_reference(
    tiny: Path, prompts_and_greedy: tuple, chunk: int, prefix_cache: bool
) -> None:
    """Mixed prompts decoded in one batch, prefilled whole or in chunks of 37 or 8 rows (the
    decoder layers trimmed to their halo before each anchor); with the prefix cache (a
    checkpoint every 16 tokens) every prompt is sent twice, the second time resumed from the
    first's checkpoints: the same tokens each time."""
    prompts, want = prompts_and_greedy
    llm = LLM(
        tiny,
        **{**POOL, "max_num_batched_tokens": chunk},
        enable_prefix_caching=prefix_cache,
        prefix_cache_checkpoint_interval=16,
    )
    rounds = 2 if prefix_cache else 1
    for _ in range(rounds):
        got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        assert got == want
    if prefix_cache:
        assert llm.engine.prefix_cache is not None and llm.engine.prefix_cache.stats.hits > 0


def test_decoder_layers_compute_only_their_halo(tiny: Path, prompts_and_greedy: tuple) -> None:
    """A 130-token prompt prefilled without the prefix cache: the layers after the last KV
    source see only the rows of their halo before the prompt's end (the last layer its window),
    every earlier layer every row, and the tokens are still the reference's."""
    prompts, want = prompts_and_greedy
    llm = LLM(tiny, **POOL, enable_prefix_caching=False)
    model, cfg = llm.engine.model, llm.engine.model_config
    rows: dict[int, list[int]] = {}
    hooks = [
        layer.attn.register_forward_hook(
            lambda m, args, out, i=i: rows.setdefault(i, []).append(args[0].shape[0])
        )
        for i, layer in enumerate(model.layers)
        if isinstance(layer, Block)
    ]
    try:
        assert llm.generate([prompts[-1]], GREEDY)[0].token_ids == want[-1]
    finally:
        for h in hooks:
            h.remove()
    prefill = {i: r[0] for i, r in rows.items()}  # (the first step: the whole prompt)
    last = cfg.last_kv_source
    assert all(prefill[i] == 130 for i in range(last + 1))
    assert [prefill[i] for i in range(last + 1, cfg.num_layers)] == [
        cfg.halo(i) for i in range(last + 1, cfg.num_layers)
    ]
    assert prefill[cfg.num_layers - 1] == cfg.sliding_window < 130


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v41_release"), seed=2, fmt="release")


def test_release_layout_dequantized_at_load_matches_the_reference(release: Path) -> None:
    """The release's formats (32 x 32 FP8 blocks, FP4 experts, FP8 Engram rows, bf16 and fp32
    tensors, two shards, the parts not served) load dequantized into the fp32 model, which
    computes what the reference computes on the weights it dequantizes itself."""
    token_ids = ids(100, 9)
    llm = LLM(release, **POOL)  # float32: dequantized at load
    err = rel_err(llm.score(token_ids), ReferenceV41(release).logits(token_ids))
    assert err < 1e-4, err


def test_quantized_compute_is_the_releases_linear(release: Path) -> None:
    """bfloat16 with the FP8 / FP4 weights kept (the CPU computes the release's arithmetic
    exactly): every FP8 linear and the FP4 experts compute linear() with activations quantized
    per 32 values, as DeepSeek-V4.1's release does (V4's groups are 128)."""
    llm = LLM(release, **POOL, dtype="bfloat16", quantized_compute=True)
    kinds = frozenset({"wq_a", "wq_b", "wkv", "wo_b", "w1", "w2", "w3", "experts"})
    assert_layers_compute_the_release(llm, read_checkpoint(release), block=32, kinds=kinds)


def test_a_gpu_refuses_quantized_compute_with_the_reason(release: Path) -> None:
    from dsaserve.engine.models.deepseek_v41 import ModelConfig, build_model

    cfg = ModelConfig.from_dir(release)
    with pytest.raises(ConfigError, match="--no-quantized-compute"):
        build_model(cfg, torch.bfloat16, torch.device("cuda"), quantized=True)
