"""Loading the DeepSeek-V4 release's checkpoint layout: FP8 and FP4 weights with ue8m0 scales,
kept quantized or dequantized at load, the MTP layer, HF's scale names, and clear errors; then
DeepSeek-V3.2's: the release's own names (convert.py's) load as HF's do, and FP8 weights kept
quantized hold the checkpoint's codes and scales."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsaserve import kernels
from dsaserve.engine.layers.experts import Fp8Experts
from dsaserve.engine.layers.fp8_linear import Fp8Linear
from dsaserve.engine.llm import LLM
from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v4.config import CSA, MOE, SLIDING, ModelConfig
from dsaserve.engine.models.deepseek_v4.tiny import FORMATS, tiny_config
from dsaserve.engine.models.deepseek_v4.weights import build_model, load_weights
from dsaserve.engine.models.loading import WeightsError
from dsaserve.kernels.quant import dequantize_fp8_blocks
from dsaserve.services import cli
from dsaserve.services import make_tiny_model as make_tiny_model_command
from tests.model_fixtures import families
from tests.release_reference import ENGINE, dequantize, read_checkpoint, release_ids

INTER = 128  # the release tiny model's moe_intermediate_size
EXPERTS = 8


@pytest.fixture(scope="module")
def raw(release):
    return read_checkpoint(release)


def _load(path, dtype=torch.float32, quantized=False):
    model = build_model(ModelConfig.from_dir(path), dtype, torch.device("cpu"), quantized)
    load_weights(model, path)
    return model


@pytest.fixture(scope="module")
def dense(release):
    return _load(release)


@pytest.fixture(scope="module")
def quantized(release):
    return _load(release, torch.bfloat16, quantized=True)


def _deq(raw, name):
    return dequantize(raw[f"{name}.weight"], raw[f"{name}.scale"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_release_config_parses_quantization_and_the_mtp_layer(release):
    cfg = ModelConfig.from_dir(release)
    assert cfg.quantization is not None and cfg.quantization.expert_dtype == "fp4"
    assert cfg.layer_types[1] == CSA and cfg.mtp_layer_types == (SLIDING,)
    assert cfg.attention_kind(cfg.num_layers) == SLIDING and cfg.mlp_kind(cfg.num_layers) == MOE
    assert cfg.vocab_size == 384


# Quantized checkpoint tensors -> (our parameter, slice): FP8 linears of every kind, wo_a (dense
# in both modes), routed experts' gate, up and down projections, the MTP layer's.
DENSE_CASES = [
    ("layers.1.attn.wq_b", lambda m: m.layers[1].attn.wq_b.weight),
    ("layers.1.attn.wkv", lambda m: m.layers[1].attn.wkv.weight),
    ("layers.2.attn.wo_a", lambda m: m.layers[2].attn.wo_a),
    ("layers.3.attn.indexer.wq_b", lambda m: m.layers[3].attn.indexer.wq_b.weight),
    ("layers.4.ffn.shared_experts.w2", lambda m: m.layers[4].ffn.shared_experts.w2.weight),
    ("layers.4.ffn.experts.5.w1", lambda m: m.layers[4].ffn.experts.w13[5, :INTER]),
    ("layers.4.ffn.experts.5.w3", lambda m: m.layers[4].ffn.experts.w13[5, INTER:]),
    ("layers.0.ffn.experts.7.w2", lambda m: m.layers[0].ffn.experts.w2[7]),
    ("mtp.0.e_proj", lambda m: m.mtp[0].e_proj.weight),
    ("mtp.0.ffn.experts.2.w3", lambda m: m.mtp[0].ffn.experts.w13[2, INTER:]),
]


@pytest.mark.parametrize("name, param", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dequantized_weights_equal_an_independent_decoding_bit_for_bit(dense, raw, name, param):
    assert torch.equal(param(dense), _deq(raw, name).float())


def test_dequantized_bf16_weights_are_exact(release, raw):
    """FP8 and FP4 values times power-of-two scales fit bf16: no rounding at load."""
    bf16 = _load(release, torch.bfloat16)
    for name, param in DENSE_CASES:
        assert torch.equal(param(bf16).double(), _deq(raw, name)), name


def test_quantized_model_keeps_the_checkpoint_bytes(quantized, raw):
    for layer, module in (("layers.1", quantized.layers[1]), ("mtp.0", quantized.mtp[0])):
        for name, linear in (
            ("attn.wq_a", module.attn.wq_a),
            ("attn.wo_b", module.attn.wo_b),
            ("ffn.shared_experts.w3", module.ffn.shared_experts.w3),
        ):
            assert linear.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(_bits(linear.weight), _bits(raw[f"{layer}.{name}.weight"]))
            assert torch.equal(_bits(linear.scale), _bits(raw[f"{layer}.{name}.scale"]))
    # wo_a stays dense (the release's convert.py dequantizes it): bf16, exactly the FP8 values
    assert torch.equal(quantized.layers[2].attn.wo_a.double(), _deq(raw, "layers.2.attn.wo_a"))


@pytest.mark.parametrize("prefix", ["layers.3", "mtp.0"])
def test_fp4_experts_are_stacked_as_the_kernel_wants(quantized, raw, prefix):
    experts = (quantized.layers[3] if prefix == "layers.3" else quantized.mtp[0]).ffn.experts

    def parts(w, kind):
        return [raw[f"{prefix}.ffn.experts.{e}.{w}.{kind}"] for e in range(EXPERTS)]

    want = kernels.stack_fp4_experts(
        parts("w1", "weight"),
        parts("w1", "scale"),
        parts("w3", "weight"),
        parts("w3", "scale"),
        parts("w2", "weight"),
        parts("w2", "scale"),
    )
    for got, expected in zip((experts.w13, experts.s13, experts.w2, experts.s2), want, strict=True):
        assert got.dtype == expected.dtype and torch.equal(_bits(got), _bits(expected))


def _rewrite(src, dst, edit):
    """Copy a release checkpoint; edit(tensors) changes its tensors in place and returns the
    names of each new shard's tensors."""
    shutil.copytree(src, dst)
    tensors = read_checkpoint(dst)
    for f in dst.glob("model-*.safetensors"):
        f.unlink()
    groups = edit(tensors)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, dst / file)
        weight_map |= dict.fromkeys(names, file)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_hf_scale_names_in_another_shard_load_the_same(release, dense, quantized, tmp_path):
    """`weight_scale_inv` (HF's name) in a shard of their own: every weight/scale pair straddles
    two files."""

    def edit(t):
        for name in [n for n in t if n.endswith(".scale") and n[:-6] + ".weight" in t]:
            t[name[:-6] + ".weight_scale_inv"] = t.pop(name)
        scales = [n for n in t if n.endswith("_scale_inv")]
        return [[n for n in t if n not in scales], scales]

    path = _rewrite(release, tmp_path / "hf", edit)
    for ours, model in ((_load(path), dense), (_load(path, torch.bfloat16, True), quantized)):
        for (name, a), b in zip(
            ours.state_dict().items(), model.state_dict().values(), strict=True
        ):
            assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous())), name


def test_a_checkpoint_without_mtp_tensors_drops_the_mtp_layer(release, tmp_path):
    path = _rewrite(
        release, tmp_path / "no_mtp", lambda t: [[n for n in t if not n.startswith("mtp.")]]
    )
    assert len(_load(path).mtp) == 0 and len(_load(path, torch.bfloat16, True).mtp) == 0


def test_a_config_without_mtp_layers_skips_the_mtp_tensors(release, tmp_path):
    path = shutil.copytree(release, tmp_path / "mtp_off")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    assert len(_load(path).mtp) == 0


def test_format_errors_are_named(release, tmp_path):
    def edit(t):
        t["layers.0.attn.wq_a.weight"] = torch.zeros(128, 128, dtype=torch.bfloat16)
        del t["layers.0.attn.wq_a.scale"]
        del t["layers.1.attn.wq_b.scale"]  # an FP8 weight without its scale
        del t["mtp.0.hnorm.weight"]
        return [list(t)]

    path = _rewrite(release, tmp_path / "broken", edit)
    with pytest.raises(WeightsError) as err:
        _load(path)
    msg = str(err.value)
    assert "wrong format (1): layers.1.attn.wq_b.weight: F8_E4M3 without a scale" in msg
    assert "missing (1): mtp.0.hnorm.weight" in msg
    with pytest.raises(WeightsError) as err:
        _load(path, torch.bfloat16, quantized=True)
    msg = str(err.value)
    assert "layers.0.attn.wq_a.weight: torch.bfloat16 without a scale; the model keeps it FP8" in (
        msg
    )
    assert "layers.0.attn.wq_a.scale" in msg  # the quantized model's scale stays unfilled


def test_quantized_compute_needs_a_quantized_checkpoint():
    with pytest.raises(ConfigError, match="no `quantization_config`"):
        build_model(ModelConfig.from_hf(tiny_config(262)), torch.bfloat16, "cpu", quantized=True)


def test_make_tiny_model_command_writes_the_release_format(tmp_path, capsys):
    assert make_tiny_model_command.FORMATS == FORMATS  # (kept apart so --help needs no torch)
    cli.main(["make-tiny-model", str(tmp_path / "m"), "--format", "release", "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert len(_load(tmp_path / "m", torch.bfloat16, quantized=True).mtp) == 1


# ---------------------------------------------------------------- DeepSeek-V3.2's own (at the end:
# a module fixture is kept for one family at a time, and the module's `release` above is V4's)


@families("deepseek_v32")
def test_release_names_load_as_the_hf_names_do(release, tmp_path):
    """The same checkpoint renamed as the release's convert.py writes it (`layers.N.attn.wq_a`,
    `.scale`, `ffn.gate.bias`; the MTP layer dropped) gives the same logits."""
    from dsaserve.engine.models.deepseek_v32.weights import canonical_name

    path = release
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    renamed = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = canonical_name(key.replace(".weight_scale_inv", ".weight"), layers)
                if name.startswith("mtp."):
                    continue
                if key.endswith(".weight_scale_inv"):
                    name = name.removesuffix(".weight") + ".scale"
                elif name.endswith(".attn.wkv_b"):
                    name += ".weight"
                renamed[name] = f.get_tensor(key)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / file, tmp_path / file)
    save_file(renamed, tmp_path / "model.safetensors")
    token_ids = release_ids(40, 11)
    ours = LLM(tmp_path, **ENGINE).score(token_ids)
    assert torch.equal(ours, LLM(path, **ENGINE).score(token_ids))


@families("deepseek_v32")
def test_fp8_weights_kept_quantized_hold_the_checkpoints_codes_and_scales(family, release):
    """Loaded for quantized compute (bfloat16), every FP8 linear and every routed expert holds
    the checkpoint's codes and its fp32 weight_scale_inv as ue8m0 scales: dequantized, exactly
    the fp32 model's weights (what test_release_parity.py holds to HF); the absorbed wkv_b is
    dense in both."""
    path = release
    models = family.package
    cfg = models.ModelConfig.from_dir(path)
    kept = models.build_model(cfg, torch.bfloat16, torch.device("cpu"), quantized=True)
    dense = models.build_model(cfg, torch.float32, torch.device("cpu"))
    models.load_weights(kept, path)
    models.load_weights(dense, path)
    linears = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    # 3 layers and the MTP layer: q_a, q_b, kv_a, o, the indexer's wq_b and wk; w1, w2, w3 of
    # the dense MLP or the shared experts
    assert len(linears) == 4 * (6 + 3)
    weights = dict(dense.named_parameters())
    for name, linear in linears.items():
        dequantized = dequantize_fp8_blocks(linear.weight, linear.scale)
        assert torch.equal(dequantized, weights[name + ".weight"]), name
    assert kept.layers[0].attn.wkv_b.dtype == torch.bfloat16
    experts = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Experts)}
    assert len(experts) == 3  # layers 1, 2 and the MTP layer
    for name, module in experts.items():
        for codes, scales in (("w13", "s13"), ("w2", "s2")):
            want = weights[f"{name}.{codes}"]
            for e in range(want.shape[0]):
                got = dequantize_fp8_blocks(getattr(module, codes)[e], getattr(module, scales)[e])
                assert torch.equal(got, want[e]), (name, codes, e)
