"""config.json parsing and checkpoint loading: legacy names, sharding, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import (
    make_tiny_model,
    release_tiny_config,
    tiny_config,
)
from dsaserve.engine.models.deepseek_v4.weights import build_model, load_weights
from dsaserve.engine.models.loading import WeightsError

RELEASE_QC = release_tiny_config()["quantization_config"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_legacy_field_names_are_accepted():
    raw = tiny_config(262)
    for key in ("layer_types", "compress_rates", "mlp_layer_types"):
        raw.pop(key)
    raw.update(
        compress_ratios=[0, 4, 128, 4, 128, 4],
        num_hash_layers=1,
        compress_rate_hca=64,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    )
    cfg = ModelConfig.from_hf(raw)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA, HCA, CSA)
    assert cfg.compress_rates == {CSA: 4, HCA: 64}
    assert cfg.mlp_layer_types == (HASH_MOE,) + (MOE,) * 5
    assert cfg.rope_dim == 8 and cfg.rope_compress.factor == 16 and cfg.rope_main.factor is None


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.scale_fmt"),
        (
            {"quantization_config": {**RELEASE_QC, "weight_block_size": [64, 64]}},
            "quantization_config.weight_block_size",
        ),
        ({"quantization_config": {**RELEASE_QC, "expert_dtype": "int4"}}, "expert_dtype"),
        ({"expert_dtype": "fp4"}, "expert_dtype"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
        ({"compress_ratios": [0, 4, 3, 4, 128, 4], "layer_types": None}, "compress_ratios"),
        ({"o_groups": 3}, "o_groups"),
        ({"hidden_size": 60}, "hidden_size"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope_parameters.compress.rope_type"),
        ({"num_hidden_layers": "six"}, "num_hidden_layers"),
    ],
)
def test_unservable_config_names_the_field(change, field):
    raw = {**tiny_config(262), **change}
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ModelConfig.from_hf(raw)


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_dir(tmp_path)


def _load(path):
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    load_weights(model, path)
    return model


def test_sharded_checkpoint_loads_like_the_single_file(tiny, tmp_path):
    shard_dir = _copy(tiny, tmp_path / "sharded")
    tensors = load_file(shard_dir / "model.safetensors")
    (shard_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, shard_dir / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = _load(tiny), _load(shard_dir)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def _edit_checkpoint(src, dst, edit):
    path = _copy(src, dst)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return path


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(tiny, tmp_path):
    def edit(t):
        del t["layers.1.attn.indexer.wq_b.weight"]
        del t["layers.2.ffn.experts.3.w3.weight"]
        t["layers.0.attn.bogus.weight"] = torch.zeros(2)
        t["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
        t["mtp.0.emb.weight"] = torch.zeros(1)  # multi-token prediction: skipped silently

    path = _edit_checkpoint(tiny, tmp_path / "broken", edit)
    with pytest.raises(WeightsError) as err:
        _load(path)
    msg = str(err.value)
    assert (
        "missing (2)" in msg
        and "layers.1.attn.indexer.wq_b.weight" in msg
        and "layers.2.ffn.experts.3.w3.weight" in msg
    )
    assert "unexpected (1): layers.0.attn.bogus.weight" in msg
    assert (
        "wrong shape (1): layers.0.attn.wkv.weight: checkpoint [3, 3], model expects [64, 64]"
        in msg
    )
    assert "mtp" not in msg


def test_hf_save_pretrained_names_load(tmp_path):
    """The names transformers writes (model. prefix, embed_tokens, hc_head.hc_fn) map onto ours."""
    from tests.hf_reference import make_hf_checkpoint

    hf = make_hf_checkpoint(tmp_path, seed=5)
    ours = _load(tmp_path)
    torch.testing.assert_close(ours.embed.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.hc_head.fn, hf.model.hc_head.hc_fn, rtol=0, atol=0)
    experts = hf.model.layers[3].mlp.experts
    torch.testing.assert_close(ours.layers[3].ffn.experts.w13, experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.layers[3].ffn.experts.w2, experts.down_proj, rtol=0, atol=0)
