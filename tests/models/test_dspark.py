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


@pytest.fixture(scope="module")
def dspark_release(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("dspark-release"), fmt="release", draft="dspark")


@pytest.mark.parametrize("dtype, quantized", [("float32", False), ("bfloat16", True)])
def test_the_release_layout_loads_with_its_formats_and_drafts(dspark_release, dtype, quantized):
    """V4-Flash-0731's layout in miniature (FP8 draft layers and main_proj with their scales,
    FP4 experts, bf16 Markov head, fp32 confidence head, two shards): loaded dequantized or
    kept quantized, the head drafts; in fp32 greedy tokens are those without speculation (in
    bf16 a verify step's rows round otherwise than one decode row's: near ties may part)."""
    from dsaserve.engine.layers.fp8_linear import Fp8Linear
    from dsaserve.engine.llm import LLM

    options = dict(max_num_seqs=2, enable_prefix_caching=False, dtype=dtype,
                   quantized_compute=quantized)  # fmt: skip
    spec = LLM(dspark_release, speculative_config=SPEC, **options)
    head = spec.engine.model.dspark
    assert head is not None and len(head.layers) == 3 and head.confidence_head is not None
    assert isinstance(head.main_proj, Fp8Linear) == quantized
    prompt = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0)
    got = spec.generate([prompt], params)[0].token_ids
    assert len(got) == 12 and spec.engine.speculator.stats.num_drafts > 0
    if not quantized:
        assert got == LLM(dspark_release, **options).generate([prompt], params)[0].token_ids


def test_hf_names_load_as_the_releases_and_a_missing_confidence_head_is_dropped(
    dspark_tiny, tmp_path
):
    """The head under HF's spellings (`model.` prefix, `hc_head.hc_fn`, `attn.norm`) loads the
    same tensors; a checkpoint without `confidence_head.*` drafts without confidences (vLLM
    drops the head too), so adaptive verification falls back to the measured acceptance."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dsaserve.engine.llm import LLM

    def respell(name: str) -> str:
        name = name.replace("hc_head_", "hc_head.hc_").replace(".attn.kv_norm.", ".attn.norm.")
        return "model." + name

    hf = shutil.copytree(dspark_tiny, tmp_path / "hf")
    weights = load_file(hf / "model.safetensors")
    save_file({respell(k): v for k, v in weights.items()
               if "confidence_head" not in k}, hf / "model.safetensors")  # fmt: skip
    options = dict(max_num_seqs=2, enable_prefix_caching=False, speculative_config=SPEC)
    ours, theirs = LLM(dspark_tiny, **options).engine, LLM(hf, **options).engine
    assert theirs.model.dspark.confidence_head is None
    mine = dict(ours.model.dspark.named_parameters())
    for name, p in theirs.model.dspark.named_parameters():
        assert torch.equal(p, mine[name]), name
    theirs.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0))
    theirs.step()
    req = theirs.scheduler.requests["a"]
    assert req.draft_token_ids and req.draft_confidences == []


def test_make_tiny_model_writes_a_dspark_head_in_the_releases_layout(tmp_path):
    """`dsaserve make-tiny-model DIR --draft dspark --format release`: the dspark_* fields, the
    head's tensors under mtp.{0,1,2} (main_proj FP8 with its scale under mtp.0, the head stack
    under mtp.2), no MTP layer's."""
    from safetensors import safe_open

    from dsaserve.services import cli

    cli.main(["make-tiny-model", str(tmp_path / "m"), "--draft", "dspark", "--format", "release"])
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["dspark_block_size"] == 5 and raw["dspark_target_layer_ids"] == [3, 4, 5]
    names = set()
    for shard in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names |= set(f.keys())
    assert {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight",
            "mtp.2.norm.weight", "mtp.2.hc_head_fn", "mtp.2.markov_head.markov_w1.weight",
            "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wq_a.scale"} <= names  # fmt: skip
    assert not any(n.startswith("mtp.0.e_proj") or n.startswith("mtp.3.") for n in names)
