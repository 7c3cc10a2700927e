"""The DSpark head (models.deepseek_v4.dspark) against the plain-torch reference written from the
published description (tests/dspark_reference.py), on a tiny random checkpoint: the drafts and
confidences the engine proposes, step after step, are the reference's for the same tokens; and
the checkpoint's fields and names are read as the release writes them."""

from __future__ import annotations

import json

import pytest
import torch

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine.models.deepseek_v4.config import SLIDING, ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model
from dsaserve.engine.sampling_params import SamplingParams
from tests.dspark_reference import DSparkReference

SPEC = '{"method": "dspark"}'


@pytest.fixture(scope="module")
def dspark_tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("dspark"), draft="dspark")


def _reference(model_dir) -> tuple:
    from transformers import DeepseekV4ForCausalLM

    raw = json.loads((model_dir / "config.json").read_text())
    target = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = DSparkReference(
        target.config, 3, raw["dspark_target_layer_ids"], raw["dspark_markov_rank"],
        raw["dspark_noise_token_id"],
    ).eval()  # fmt: skip
    ref.load_release(model_dir)
    return target, ref


@torch.no_grad()
def _reference_block(target, ref, tokens: list[int], gamma: int, vocab: int):
    """The reference's drafts and confidences for the block anchored at the last of `tokens`."""
    ids = torch.tensor([tokens])
    taps = ref.target_taps(target, ids[:, :-1])
    h, base = ref(target, taps, ids, torch.tensor([[len(tokens) - 1]]), gamma)
    return ref.draft(h[0], base[0], ids[:, -1], vocab)


def test_the_config_marks_a_dspark_head_and_its_layers(dspark_tiny):
    cfg = ModelConfig.from_dir(dspark_tiny)
    assert cfg.dspark is not None and cfg.draft_kind == "dspark"
    assert cfg.dspark.block_size == 5 and cfg.dspark.num_layers == 3
    assert cfg.mtp_layer_types == (SLIDING,) * 3  # (no MTP layer, whatever num_nextn says)


def test_engine_drafts_what_the_reference_drafts_step_after_step(dspark_tiny):
    """A prompt past the sliding window, decoded greedily: at every step the engine's draft
    block (its context written by every target step, rejected rows included, in rings with
    spare rows) drafts the tokens and confidences the reference computes from scratch."""
    target, ref = _reference(dspark_tiny)
    engine = LLMEngine(
        dspark_tiny,
        EngineConfig(speculative_config=SPEC, max_num_seqs=2, enable_prefix_caching=False),
    )
    vocab, gamma = engine.tokenizer.vocab_size, engine.speculative.num_speculative_tokens
    prompt = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("a", prompt, SamplingParams(max_tokens=64, temperature=0))
    req = engine.scheduler.requests["a"]
    checked = 0
    while checked < 6:
        engine.step()
        if not req.draft_token_ids:
            continue
        tokens = prompt + req.output_token_ids
        drafts, conf = _reference_block(target, ref, tokens, gamma, vocab)
        assert req.draft_token_ids == drafts[0].tolist(), f"step {checked}"
        assert conf is not None
        assert torch.allclose(torch.tensor(req.draft_confidences), conf[0], atol=1e-4)
        checked += 1
    engine.abort("a")
