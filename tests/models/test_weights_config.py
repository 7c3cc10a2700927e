"""config.json parsing and checkpoint loading, for each family: fields this engine cannot serve
named (V4.1's: its CSA2 topology, Engram's fields, the DSpark head's trailing compress ratios,
its 32 x 32 blocks), sharded checkpoints, missing, unexpected and misshaped tensors listed (what
V4.1 does not serve skipped), the family found by model_type; then V4's legacy names and HF's
save_pretrained names, and V3.2's config in HF's names and the release's, its RoPE and softmax
scale against HF's, its KV description and tensor parallel splits, and scales that are not
ue8m0."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaserve.engine import models
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v4.tiny import release_tiny_config as v4_release_config
from dsaserve.engine.models.loading import WeightsError
from tests.model_fixtures import Family, families

# the tiny models' vocabularies (V3.2's: its release tokenizer's; V4.1's: padded past its 265)
VOCAB = {"deepseek_v4": 262, "deepseek_v32": 264, "deepseek_v41": 272}
V41_QC = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
RELEASE_QC = v4_release_config()["quantization_config"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _load(family: Family, path):
    cfg = family.package.ModelConfig.from_dir(path)
    model = family.package.build_model(cfg, torch.float32, torch.device("cpu"))
    family.package.load_weights(model, path)
    return model


@pytest.mark.parametrize(
    "family, change, message",
    [
        *(
            ("deepseek_v4", change, f"`{name}`")
            for change, name in [
                ({"model_type": "llama"}, "model_type"),
                ({"num_key_value_heads": 8}, "num_key_value_heads"),
                ({"scoring_func": "softmax"}, "scoring_func"),
                (
                    {"quantization_config": {"quant_method": "awq"}},
                    "quantization_config.quant_method",
                ),
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
                (
                    {"rope_scaling": {"type": "dynamic", "factor": 2}},
                    "rope_parameters.compress.rope_type",
                ),
                ({"num_hidden_layers": "six"}, "num_hidden_layers"),
            ]
        ),
        *(
            ("deepseek_v32", change, message)
            for change, message in [
                ({"n_group": 3}, "`n_group`: must divide n_routed_experts"),
                ({"topk_group": 5}, "`topk_group`: must be in"),
                ({"num_experts_per_tok": 5}, "`num_experts_per_tok`: must be in"),
                ({"scoring_func": "softmax"}, "`scoring_func`: must be 'sigmoid'"),
                ({"index_head_dim": 48}, "`index_head_dim`: must be a power of two"),
                ({"kv_lora_rank": 48}, "`kv_lora_rank`: must be a power of two"),
                ({"q_lora_rank": 0}, "`q_lora_rank`: must be > 0"),
                (
                    {"mlp_layer_types": ["dense", "moe", "sparse"]},
                    "entries must be 'dense' or 'sparse'",
                ),
                ({"model_type": "deepseek_v3"}, "`model_type`: must be 'deepseek_v32'"),
                ({"dtype": "fp8", "scale_fmt": None}, "`scale_fmt`: must be 'ue8m0'"),
            ]
        ),
        *(
            ("deepseek_v41", change, message)
            for change, message in [
                ({"model_type": "deepseek_v4"}, "`model_type`: must be 'deepseek_v41'"),
                ({"num_key_value_heads": 8}, "`num_key_value_heads`"),
                # the release's trailing entries are the DSpark head's: zeros, or refused
                (
                    {"compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 2]},
                    "`compress_ratios`: entries past the 8 layers",
                ),
                ({"compress_ratios": [0, 4, 4, 4, 1, 1, 1, 1]}, "entries must be 0, 1 or 2"),
                ({"kv_source_layer_ids": [3, 4]}, "`kv_source_layer_ids`: layer 1 .ratio 2."),
                ({"kv_source_layer_ids": [1, 3, 4, 5]}, "must also run an indexer"),
                ({"candidate_topk_blocks": 1}, "`candidate_topk_blocks`"),
                ({"num_experts_per_tok": 1}, "`num_experts_per_tok`: must be in"),
                ({"engram_head_dim": 48}, "`engram_head_dim`: must be a multiple of 32"),
                ({"engram_num_embeddings": [184]}, "`engram_num_embeddings`: needs one entry"),
                (
                    {"quantization_config": {**V41_QC, "weight_block_size": [128, 128]}},
                    "`quantization_config.weight_block_size`: must be .32, 32.",
                ),
                (
                    {"quantization_config": {**V41_QC, "expert_dtype": "fp8"}},
                    "`quantization_config.expert_dtype`: must be 'fp4'",
                ),
            ]
        ),
    ],
    indirect=["family"],
)
def test_unservable_config_names_the_field(family, change, message):
    raw = family.tiny.tiny_config(VOCAB[family.name]) | change
    with pytest.raises(ConfigError, match=message):
        family.package.ModelConfig.from_hf(raw)


@families()
def test_missing_config_json_is_a_clear_error(family, tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        family.package.ModelConfig.from_dir(tmp_path)


@families()
def test_the_registry_serves_each_family(family, tiny):
    found = models.family(tiny)
    assert found.ModelConfig is family.package.ModelConfig
    cfg = found.ModelConfig.from_dir(tiny)
    model = found.build_model(cfg, torch.float32, torch.device("cpu"))
    found.load_weights(model, tiny)


@families()
def test_sharded_checkpoint_loads_like_the_single_file(family, tiny, tmp_path):
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
    a, b = _load(family, tiny), _load(family, shard_dir)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@dataclass(frozen=True)
class Broken:
    """Tensors changed in a tiny checkpoint (None: deleted), and what the loader's error says."""

    edits: dict[str, torch.Tensor | None]
    says: list[str]
    never_says: list[str] = field(default_factory=list)


BROKEN = {
    "deepseek_v4": Broken(
        {
            "layers.1.attn.indexer.wq_b.weight": None,
            "layers.2.ffn.experts.3.w3.weight": None,
            "layers.0.attn.bogus.weight": torch.zeros(2),
            "layers.0.attn.wkv.weight": torch.zeros(3, 3),
            "mtp.0.emb.weight": torch.zeros(1),  # multi-token prediction: skipped silently
        },
        [
            "missing (2)",
            "layers.1.attn.indexer.wq_b.weight",
            "layers.2.ffn.experts.3.w3.weight",
            "unexpected (1): layers.0.attn.bogus.weight",
            "wrong shape (1): layers.0.attn.wkv.weight: checkpoint [3, 3], model expects [64, 64]",
        ],
        ["mtp"],
    ),
    "deepseek_v32": Broken(
        {
            "model.layers.2.self_attn.indexer.k_norm.bias": None,
            "model.layers.0.self_attn.extra.weight": torch.zeros(2),
        },
        [
            "missing (1): layers.2.attn.indexer.k_norm.bias",
            "unexpected (1): model.layers.0.self_attn.extra.weight",
        ],
    ),
    "deepseek_v41": Broken(
        {
            "layers.1.attn.indexer.wk.weight": None,
            "layers.2.ffn.experts.3.w3.weight": None,
            "layers.0.attn.bogus.weight": torch.zeros(2),
            "layers.0.attn.wkv.weight": torch.zeros(3, 3),
            # not served: the DSpark head, the image tokens' routing bias, the vision tower
            "mtp.0.attn.wq_a.weight": torch.zeros(1),
            "layers.0.ffn.gate.bias_vl": torch.zeros(1),
            "vision.patch_embed.proj.weight": torch.zeros(1),
        },
        [
            "missing (2)",
            "layers.1.attn.indexer.wk.weight",
            "layers.2.ffn.experts.3.w3.weight",
            "unexpected (1): layers.0.attn.bogus.weight",
            "wrong shape (1): layers.0.attn.wkv.weight: checkpoint [3, 3], model expects [64, 64]",
        ],
        ["mtp", "bias_vl", "vision"],
    ),
}


@families()
def test_missing_unexpected_and_misshaped_tensors_are_all_listed(family, tiny, tmp_path):
    broken = BROKEN[family.name]
    path = _copy(tiny, tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    for name, tensor in broken.edits.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightsError) as err:
        _load(family, path)
    msg = str(err.value)
    for line in broken.says:
        assert line in msg, line
    for word in broken.never_says:
        assert word not in msg, word


# ---------------------------------------------------------------- DeepSeek-V4's own


@families("deepseek_v4")
def test_legacy_field_names_are_accepted(family):
    from dsaserve.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING

    raw = family.tiny.tiny_config(262)
    for key in ("layer_types", "compress_rates", "mlp_layer_types"):
        raw.pop(key)
    raw.update(
        compress_ratios=[0, 4, 128, 4, 128, 4],
        num_hash_layers=1,
        compress_rate_hca=64,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    )
    cfg = family.package.ModelConfig.from_hf(raw)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA, HCA, CSA)
    assert cfg.compress_rates == {CSA: 4, HCA: 64}
    assert cfg.mlp_layer_types == (HASH_MOE,) + (MOE,) * 5
    assert cfg.rope_dim == 8 and cfg.rope_compress.factor == 16 and cfg.rope_main.factor is None


@families("deepseek_v4")
def test_hf_save_pretrained_names_load(family, tmp_path):
    """The names transformers writes (model. prefix, embed_tokens, hc_head.hc_fn) map onto ours."""
    hf = family.hf.make_hf_checkpoint(tmp_path, seed=5)
    ours = _load(family, tmp_path)
    torch.testing.assert_close(ours.embed.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.hc_head.fn, hf.model.hc_head.hc_fn, rtol=0, atol=0)
    experts = hf.model.layers[3].mlp.experts
    torch.testing.assert_close(ours.layers[3].ffn.experts.w13, experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.layers[3].ffn.experts.w2, experts.down_proj, rtol=0, atol=0)


# ---------------------------------------------------------------- DeepSeek-V3.2's own


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}


@families("deepseek_v32")
@pytest.mark.parametrize(
    "rope",
    [
        {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # the release's: cos/sin unscaled
        YARN,  # no mscale: HF scales cos/sin by 0.1 ln(40) + 1 and leaves the softmax alone
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "default", "rope_theta": 50000.0},
    ],
)
def test_rope_table_and_softmax_scale_are_hfs(family, rope):
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention,
        DeepseekV32RotaryEmbedding,
    )

    from dsaserve.engine.layers.rope import RotaryTable

    raw = family.tiny.tiny_config(264) | {
        "rope_parameters": rope,
        "max_position_embeddings": 163840,
    }
    del raw["rope_scaling"]
    ours = family.package.ModelConfig.from_hf(raw)
    hf_config = DeepseekV32Config(**{k: v for k, v in raw.items() if k != "dtype"})
    attention = DeepseekV32Attention(hf_config, 0)
    assert ours.softmax_scale == pytest.approx(attention.scaling, rel=1e-12)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 100000])
    cos, sin = RotaryTable(ours.rope, ours.qk_rope_head_dim)(positions, torch.float32)
    hf_cos, hf_sin = DeepseekV32RotaryEmbedding(hf_config)(cos, positions[None])
    half = ours.qk_rope_head_dim // 2  # HF repeats the angles: cat(freqs, freqs)
    torch.testing.assert_close(cos, hf_cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :half], rtol=0, atol=0)


@families("deepseek_v32")
def test_release_names_read_as_hfs(family):
    """The release's inference config names (and its YaRN fields) give the same config."""
    ModelConfig = family.package.ModelConfig
    hf = family.tiny.release_tiny_config()
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


@families("deepseek_v32")
def test_kv_description_names_the_family_and_its_rows(family):
    ModelConfig = family.package.ModelConfig
    cfg = ModelConfig.from_hf(family.tiny.release_tiny_config())
    (group,) = cfg.kv_groups()
    assert (group.layers, group.ratio, group.indexed) == ((0, 1, 2), 1, True)
    assert (cfg.head_dim, cfg.rope_dim, cfg.sliding_window) == (64 + 16, 16, 0)
    assert cfg.compressor_rings() == ()
    assert cfg.family == "deepseek_v32"
    full = ModelConfig.from_hf({"model_type": "deepseek_v32"})  # HF's defaults: the release
    assert (full.head_dim, full.index_head_dim, full.index_topk) == (576, 128, 2048)
    assert full.softmax_scale == pytest.approx(192**-0.5)  # no rope_scaling given


@families("deepseek_v32")
def test_tensor_parallel_splits_heads_experts_and_fp8_blocks(family):
    ModelConfig = family.package.ModelConfig
    cfg = ModelConfig.from_hf(family.tiny.release_tiny_config())
    cfg.check_tensor_parallel(2, fp8=True)  # the release tiny model splits over two ranks
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by 8"):
        cfg.check_tensor_parallel(8, fp8=False)
    narrow = ModelConfig.from_hf(family.tiny.release_tiny_config() | {"v_head_dim": 32})
    narrow.check_tensor_parallel(2, fp8=False)
    with pytest.raises(ConfigError, match=r"o_proj's input \(heads x v_head_dim\) \(64 per rank"):
        narrow.check_tensor_parallel(2, fp8=True)


@families("deepseek_v32")
def test_scales_that_are_not_powers_of_two_are_refused(family, tmp_path):
    """DeepSeek-V3's fp32 weight_scale_inv (any value) is not ue8m0: refused by name, whether the
    weights are kept quantized or dequantized."""
    path = family.make_tiny_model(tmp_path, fmt="release")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    file = path / index[name]
    tensors = load_file(file)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, file)
    cfg = family.package.ModelConfig.from_dir(path)
    for dtype, quantized in ((torch.float32, False), (torch.bfloat16, True)):
        model = family.package.build_model(cfg, dtype, torch.device("cpu"), quantized=quantized)
        with pytest.raises(WeightsError, match="q_b_proj.*not all positive powers of two"):
            family.package.load_weights(model, path)


# ---------------------------------------------------------------- DeepSeek-V4.1's own

V41_DSPARK = {  # the release's DSpark fields (shared/reference/v41-dspark.md section 1.3)
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 257,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
}


@families("deepseek_v41")
def test_v41_reads_its_dspark_head_as_v4_does(family):
    """The DSpark head's fields are read and checked by the spec V4's head uses (the seam a V4.1
    drafter fills); the head itself is not run: no draft layers in the config."""
    cfg = family.package.ModelConfig.from_hf(family.tiny.tiny_config(272) | V41_DSPARK)
    assert cfg.dspark is not None and cfg.dspark.target_layer_ids == (5, 6, 7)
    assert (cfg.dspark.block_size, cfg.dspark.num_experts_per_tok) == (5, 3)
    assert not hasattr(cfg, "draft_layers")
    wrong = family.tiny.tiny_config(272) | V41_DSPARK | {"dspark_target_layer_ids": [7, 9]}
    with pytest.raises(ConfigError, match="`dspark_target_layer_ids`"):
        family.package.ModelConfig.from_hf(wrong)
