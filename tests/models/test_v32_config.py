"""DeepSeek-V3.2's config.json (HF's names and the release's), its RoPE and softmax scale
against HF's, its KV description, and checkpoints that do not fit it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32RotaryEmbedding,
)

from dsaserve.engine import models
from dsaserve.engine.layers.rope import RotaryTable
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v32.config import ModelConfig
from dsaserve.engine.models.deepseek_v32.tiny import (
    make_tiny_model,
    release_tiny_config,
    tiny_config,
)
from dsaserve.engine.models.deepseek_v32.weights import build_model, load_weights
from dsaserve.engine.models.loading import WeightsError

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}


@pytest.mark.parametrize(
    "rope",
    [
        {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # the release's: cos/sin unscaled
        YARN,  # no mscale: HF scales cos/sin by 0.1 ln(40) + 1 and leaves the softmax alone
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "default", "rope_theta": 50000.0},
    ],
)
def test_rope_table_and_softmax_scale_are_hfs(rope):
    raw = tiny_config(264) | {"rope_parameters": rope, "max_position_embeddings": 163840}
    del raw["rope_scaling"]
    ours = ModelConfig.from_hf(raw)
    hf_config = DeepseekV32Config(**{k: v for k, v in raw.items() if k != "dtype"})
    attention = DeepseekV32Attention(hf_config, 0)
    assert ours.softmax_scale == pytest.approx(attention.scaling, rel=1e-12)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 100000])
    cos, sin = RotaryTable(ours.rope, ours.qk_rope_head_dim)(positions, torch.float32)
    hf_cos, hf_sin = DeepseekV32RotaryEmbedding(hf_config)(cos, positions[None])
    half = ours.qk_rope_head_dim // 2  # HF repeats the angles: cat(freqs, freqs)
    torch.testing.assert_close(cos, hf_cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :half], rtol=0, atol=0)


def test_release_names_read_as_hfs():
    """The release's inference config names (and its YaRN fields) give the same config."""
    hf = release_tiny_config()
    renames = {
        "hidden_size": "dim",
        "intermediate_size": "inter_dim",
        "moe_intermediate_size": "moe_inter_dim",
        "num_hidden_layers": "n_layers",
        "first_k_dense_replace": "n_dense_layers",
        "num_attention_heads": "n_heads",
        "num_experts_per_tok": "n_activated_experts",
        "n_group": "n_expert_groups",
        "topk_group": "n_limited_groups",
        "routed_scaling_factor": "route_scale",
        "scoring_func": "score_func",
    }
    release = {renames.get(k, k): v for k, v in hf.items() if k not in ("rope_scaling",)}
    release |= {"rope_factor": 4.0, "original_seq_len": 1024, "mscale": 1.0}
    release |= {"beta_fast": 32, "beta_slow": 1}
    assert ModelConfig.from_hf(release) == ModelConfig.from_hf(hf)
    inference = {k: v for k, v in release.items() if k != "quantization_config"}
    assert ModelConfig.from_hf(inference | {"dtype": "fp8", "scale_fmt": "ue8m0"}) == (
        ModelConfig.from_hf(hf)
    )
    with pytest.raises(
        ConfigError, match="`num_attention_heads`: is 8 but the release's `n_heads`"
    ):
        ModelConfig.from_hf(hf | {"n_heads": 4, "num_attention_heads": 8})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "`n_group`: must divide n_routed_experts"),
        ({"topk_group": 5}, "`topk_group`: must be in"),
        ({"num_experts_per_tok": 5}, "`num_experts_per_tok`: must be in"),
        ({"scoring_func": "softmax"}, "`scoring_func`: must be 'sigmoid'"),
        ({"index_head_dim": 48}, "`index_head_dim`: must be a power of two"),
        ({"kv_lora_rank": 48}, "`kv_lora_rank`: must be a power of two"),
        ({"q_lora_rank": 0}, "`q_lora_rank`: must be > 0"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "entries must be 'dense' or 'sparse'"),
        ({"model_type": "deepseek_v3"}, "`model_type`: must be 'deepseek_v32'"),
        ({"dtype": "fp8", "scale_fmt": None}, "`scale_fmt`: must be 'ue8m0'"),
    ],
)
def test_configs_this_engine_cannot_serve_name_the_field(change, message):
    raw = tiny_config(264) | change
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_kv_description_names_the_family_and_its_rows():
    cfg = ModelConfig.from_hf(release_tiny_config())
    (group,) = cfg.kv_groups()
    assert (group.layers, group.ratio, group.indexed) == ((0, 1, 2), 1, True)
    assert (cfg.head_dim, cfg.rope_dim, cfg.sliding_window) == (64 + 16, 16, 0)
    assert cfg.compressor_rings() == ()
    assert cfg.family == "deepseek_v32"
    full = ModelConfig.from_hf({"model_type": "deepseek_v32"})  # HF's defaults: the release
    assert (full.head_dim, full.index_head_dim, full.index_topk) == (576, 128, 2048)
    assert full.softmax_scale == pytest.approx(192**-0.5)  # no rope_scaling given


def test_tensor_parallel_splits_heads_experts_and_fp8_blocks():
    cfg = ModelConfig.from_hf(release_tiny_config())
    cfg.check_tensor_parallel(2, fp8=True)  # the release tiny model splits over two ranks
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by 8"):
        cfg.check_tensor_parallel(8, fp8=False)
    narrow = ModelConfig.from_hf(release_tiny_config() | {"v_head_dim": 32})
    narrow.check_tensor_parallel(2, fp8=False)
    with pytest.raises(ConfigError, match=r"o_proj's input \(heads x v_head_dim\) \(64 per rank"):
        narrow.check_tensor_parallel(2, fp8=True)


def test_the_registry_serves_v32(tmp_path):
    path = make_tiny_model(tmp_path)
    family = models.family(path)
    assert family.ModelConfig is ModelConfig
    cfg = family.ModelConfig.from_dir(path)
    model = family.build_model(cfg, torch.float32, torch.device("cpu"))
    family.load_weights(model, path)


def test_scales_that_are_not_powers_of_two_are_refused(tmp_path):
    """DeepSeek-V3's fp32 weight_scale_inv (any value) is not ue8m0: refused by name, whether the
    weights are kept quantized or dequantized."""
    path = make_tiny_model(tmp_path, fmt="release")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    file = path / index[name]
    tensors = load_file(file)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, file)
    cfg = ModelConfig.from_dir(path)
    for dtype, quantized in ((torch.float32, False), (torch.bfloat16, True)):
        model = build_model(cfg, dtype, torch.device("cpu"), quantized=quantized)
        with pytest.raises(WeightsError, match="q_b_proj.*not all positive powers of two"):
            load_weights(model, path)


def test_missing_and_unexpected_tensors_are_reported(tmp_path):
    path = make_tiny_model(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.self_attn.indexer.k_norm.bias"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(WeightsError) as err:
        load_weights(build_model(cfg, torch.float32, torch.device("cpu")), path)
    assert "missing (1): layers.2.attn.indexer.k_norm.bias" in str(err.value)
    assert "unexpected (1): model.layers.0.self_attn.extra.weight" in str(err.value)
