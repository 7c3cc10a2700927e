"""DeepSeek-V3.2 model configuration, read from a checkpoint's `config.json`.

Accepts the field names HF transformers' `DeepseekV32Config` accepts (`first_k_dense_replace` or
`mlp_layer_types`, `rope_parameters` or the older `rope_scaling` + `rope_theta`, ...) and the
release's own names from its inference config (`dim`, `n_layers`, `n_dense_layers`, `n_heads`,
`n_activated_experts`, `n_expert_groups`, `route_scale`, `rope_factor`, `original_seq_len`,
`mscale`, `dtype: fp8` ...; see RELEASE_NAMES); a field given under both names must agree. A config
this engine cannot serve raises `ConfigError` naming the field.

Layer indices past `num_layers` are the multi-token-prediction (MTP) layers
(`num_nextn_predict_layers`), as the HF checkpoint stores them (`model.layers.61.*`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.kv.layout import LayerGroup, Ring
from dsaserve.engine.layers.rope import RopeSpec
from dsaserve.engine.model_dir import (
    FP8_BLOCK,
    check_fp8_quantization,
    check_split,
    get_field,
    read_config,
    require,
)

MODEL_TYPE = "deepseek_v32"
DENSE, SPARSE = "dense", "sparse"  # HF's mlp_layer_types: a dense MLP or the MoE
KV_GROUP = "mla"  # the one pool group: every layer keeps a latent row and an index key a token

# The release's inference config name -> HF's (inference/model.py ModelArgs; configs/*.json).
RELEASE_NAMES = {
    "dim": "hidden_size",
    "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_dense_layers": "first_k_dense_replace",
    "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok",
    "n_expert_groups": "n_group",
    "n_limited_groups": "topk_group",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
}
# The release's YaRN fields (ModelArgs), which it applies when max_seq_len > original_seq_len.
_RELEASE_ROPE = ("rope_factor", "original_seq_len", "beta_fast", "beta_slow", "mscale")


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint stores its linear weights: FP8 e4m3 with ue8m0 128 x 128 block scales
    (`<name>.weight_scale_inv` as fp32 powers of two, or the release's `<name>.scale`), routed
    experts included. Norms, router, embeddings, head and the indexer's weights_proj stay dense."""

    block: int = FP8_BLOCK


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mlp_layer_types: tuple[str, ...]  # DENSE or SPARSE per layer
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    softmax_scale: float  # of q . k in the latent space (YaRN's mscale^2 included)
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_mtp_layers: int
    quantization: Quantization | None  # None: a dense (bf16/fp32) checkpoint

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def mlp_kind(self, layer: int) -> str:
        """DENSE or SPARSE; the MTP layers (num_layers + i) are MoE layers."""
        return self.mlp_layer_types[layer] if layer < self.num_layers else SPARSE

    # ---------------------------------------------------------------- engine.kv.layout.KVModel

    @property
    def head_dim(self) -> int:
        """A cached row: the normalised latent (kv_lora_rank) then the RoPE'd key (rope dims)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def sliding_window(self) -> int:
        return 0  # no window ring: every token's row stays in the pages

    @property
    def needs_scratch_rows(self) -> bool:
        return False  # a row goes to its own slot before attention and never moves

    def kv_groups(self) -> tuple[LayerGroup, ...]:
        """One group: every layer keeps each token's latent row and its indexer key."""
        return (LayerGroup(KV_GROUP, tuple(range(self.num_layers)), ratio=1, indexed=True),)

    def compressor_rings(self) -> tuple[Ring, ...]:
        return ()

    @property
    def family(self) -> str:
        return MODEL_TYPE

    def kv_layout_fields(self) -> dict[str, object]:
        # what the stored index keys are: NeoX RoPE, then the Hadamard rotation (indexer.py)
        return {"index_keys": "rope_half_split+hadamard"}

    def check_tensor_parallel(self, size: int, fp8: bool) -> None:
        """Raise ConfigError unless `size` ranks can split this model: query heads by rank (the
        latent and the indexer whole on every rank), routed experts in contiguous ranges, the
        dense MLPs' and shared experts' intermediate dims and the vocabulary in equal parts;
        with FP8 weights kept (`fp8`), every split also falls on the 128 x 128 block grid."""
        if size == 1:
            return
        shared = self.moe_intermediate_size * self.num_shared_experts
        heads = self.num_heads // size
        check_split(
            size,
            (
                ("num_attention_heads", self.num_heads),
                ("n_routed_experts", self.num_experts),
                ("intermediate_size", self.intermediate_size),
                ("moe_intermediate_size x n_shared_experts", shared),
                ("vocab_size", self.vocab_size),
            ),
            (
                ("q_b_proj's output rows (heads x qk_head_dim)", heads * self.qk_head_dim),
                ("o_proj's input (heads x v_head_dim)", heads * self.v_head_dim),
                ("intermediate_size", self.intermediate_size // size),
                ("the shared experts' intermediate size", shared // size),
            )
            if fp8
            else (),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        return cls.from_hf(read_config(model_dir))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(_hf_names(dict(raw)))


def _hf_names(raw: dict[str, Any]) -> dict[str, Any]:
    """raw with the release's names rewritten to HF's (both given: they must agree)."""
    for release, hf in RELEASE_NAMES.items():
        if release in raw:
            value = raw.pop(release)
            require(
                raw.get(hf, value) == value,
                hf,
                f"is {raw.get(hf)!r} but the release's `{release}` says {value!r}",
            )
            raw[hf] = value
    return raw


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])
        require(len(types) >= n, "mlp_layer_types", f"has {len(types)} entries for {n} layers")
        bad = [t for t in types[:n] if t not in (DENSE, SPARSE)]
        require(not bad, "mlp_layer_types", f"entries must be 'dense' or 'sparse', got {bad}")
        return tuple(types[:n])
    dense = get_field(raw, "first_k_dense_replace", 3, int)
    require(dense >= 0, "first_k_dense_replace", f"must be >= 0, got {dense}")
    return tuple([DENSE] * min(n, dense) + [SPARSE] * max(0, n - dense))


def _rope(raw: dict[str, Any], rope_dim: int, qk_head_dim: int) -> tuple[RopeSpec, float]:
    """(the RoPE table, the attention's softmax scale), as HF's DeepseekV32 computes them: YaRN
    frequencies, cos/sin times the attention factor (1 when mscale == mscale_all_dim, as in the
    release), and the softmax scale times yarn_get_mscale(factor, mscale_all_dim)^2."""
    theta = float(get_field(raw, "rope_theta", 10000.0, (int, float)))
    # (HF's PreTrainedConfig takes rope_scaling over rope_parameters when both are given)
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if params is None and any(k in raw for k in _RELEASE_ROPE):
        # The release's fields: YaRN (its precompute_freqs_cis), cos/sin unscaled, and the
        # softmax scale times mscale(rope_factor, mscale)^2 (MLA.__init__).
        release_mscale = float(raw.get("mscale", 1.0))
        params = {
            "rope_type": "yarn",
            "factor": raw.get("rope_factor", 40),
            "original_max_position_embeddings": raw.get("original_seq_len", 4096),
            "beta_fast": raw.get("beta_fast", 32),
            "beta_slow": raw.get("beta_slow", 1),
            "mscale": release_mscale,
            "mscale_all_dim": release_mscale,
        }
    params = dict(params or {})
    require(isinstance(params, dict), "rope_parameters", "must be an object")
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default"))
    scale = qk_head_dim**-0.5
    if kind == "default":
        return RopeSpec(theta=theta), scale
    require(
        kind == "yarn", "rope_parameters.rope_type", f"must be 'default' or 'yarn', got {kind!r}"
    )
    original = params.get("original_max_position_embeddings")
    require(
        isinstance(original, int) and original > 0,
        "rope_parameters.original_max_position_embeddings",
        f"yarn needs a positive int, got {original!r}",
    )
    # no factor: HF takes the context extension itself
    factor = float(
        params.get("factor") or get_field(raw, "max_position_embeddings", 163840, int) / original
    )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if params.get("attention_factor") is not None:
        attention_factor = float(params["attention_factor"])
    elif mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    require(
        params.get("truncate", True) is True,
        "rope_parameters.truncate",
        "only the truncated YaRN correction range (HF's default) is supported",
    )
    if mscale_all_dim:
        scale *= _yarn_mscale(factor, mscale_all_dim) ** 2
    spec = RopeSpec(
        theta=theta,
        factor=factor,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=attention_factor,
    )
    return spec, scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    require(model_type == MODEL_TYPE, "model_type", f"must be {MODEL_TYPE!r}, got {model_type!r}")
    n = get_field(raw, "num_hidden_layers", 61, int)
    require(n >= 1, "num_hidden_layers", "must be >= 1")
    n_mtp = get_field(raw, "num_nextn_predict_layers", 1, int)
    require(n_mtp >= 0, "num_nextn_predict_layers", "must be >= 0")
    layer_types = raw.get("layer_types")
    require(
        layer_types is None or set(layer_types) <= {"indexed_attention"},
        "layer_types",
        "every DeepSeek-V3.2 layer is 'indexed_attention'",
    )
    hidden = get_field(raw, "hidden_size", 7168, int)
    heads = get_field(raw, "num_attention_heads", 128, int)
    q_lora = get_field(raw, "q_lora_rank", 1536, int)
    require(q_lora > 0, "q_lora_rank", "must be > 0 (every DeepSeek-V3.2 projects q low-rank)")
    kv_lora = get_field(raw, "kv_lora_rank", 512, int)
    nope = get_field(raw, "qk_nope_head_dim", 128, int)
    rope_dim = get_field(raw, "qk_rope_head_dim", 64, int)
    v_dim = get_field(raw, "v_head_dim", 128, int)
    require(rope_dim > 0 and rope_dim % 2 == 0, "qk_rope_head_dim", "must be even and > 0")
    # The sparse-MLA kernel's tiling: the latent and the RoPE part each a power of two >= 16.
    for field, value in (("kv_lora_rank", kv_lora), ("qk_rope_head_dim", rope_dim)):
        require(value >= 16 and value & (value - 1) == 0, field, "must be a power of two >= 16")
    index_heads = get_field(raw, "index_n_heads", 64, int)
    index_dim = get_field(raw, "index_head_dim", 128, int)
    # The indexer's Hadamard rotation (the release's rotate_activation) needs a power of two.
    require(
        index_dim >= 16 and index_dim & (index_dim - 1) == 0 and index_dim >= rope_dim,
        "index_head_dim",
        f"must be a power of two >= 16 and >= qk_rope_head_dim ({rope_dim}), got {index_dim}",
    )
    moe_inter = get_field(raw, "moe_intermediate_size", 2048, int)
    inter = get_field(raw, "intermediate_size", 18432, int)
    for field, value in (("hidden_size", hidden), ("moe_intermediate_size", moe_inter)):
        require(value % 8 == 0, field, f"must be a multiple of 8, got {value}")
    num_experts = get_field(raw, "n_routed_experts", 256, int)
    top_k = get_field(raw, "num_experts_per_tok", 8, int)
    n_group = get_field(raw, "n_group", 8, int)
    topk_group = get_field(raw, "topk_group", 4, int)
    require(
        n_group >= 1 and num_experts % n_group == 0 and num_experts // n_group >= 2,
        "n_group",
        f"must divide n_routed_experts ({num_experts}) into groups of >= 2 experts",
    )
    require(1 <= topk_group <= n_group, "topk_group", f"must be in [1, n_group={n_group}]")
    require(
        1 <= top_k <= topk_group * (num_experts // n_group),
        "num_experts_per_tok",
        f"must be in [1, {topk_group * (num_experts // n_group)}] (topk_group groups' experts)",
    )
    shared = get_field(raw, "n_shared_experts", 1, int)
    require(shared >= 1, "n_shared_experts", "must be >= 1")
    scoring = raw.get("scoring_func", "sigmoid")
    require(scoring == "sigmoid", "scoring_func", f"must be 'sigmoid', got {scoring!r}")
    require(raw.get("hidden_act", "silu") == "silu", "hidden_act", "only 'silu' is supported")
    for field in ("attention_bias", "mlp_bias"):
        require(not raw.get(field, False), field, "biases are not part of DeepSeek-V3.2")
    rope, softmax_scale = _rope(raw, rope_dim, nope + rope_dim)
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        vocab_size=get_field(raw, "vocab_size", 129280, int),
        hidden_size=hidden,
        intermediate_size=inter,
        moe_intermediate_size=moe_inter,
        num_layers=n,
        num_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        mlp_layer_types=_mlp_layer_types(raw, n),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        num_shared_experts=shared,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get_field(raw, "routed_scaling_factor", 2.5, (int, float))),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        index_n_heads=index_heads,
        index_head_dim=index_dim,
        index_topk=get_field(raw, "index_topk", 2048, int),
        rms_norm_eps=float(get_field(raw, "rms_norm_eps", 1e-6, (int, float))),
        max_position_embeddings=get_field(raw, "max_position_embeddings", 163840, int),
        rope=rope,
        softmax_scale=softmax_scale,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_mtp_layers=n_mtp,
        quantization=_quantization(raw),
    )


def _quantization(raw: dict[str, Any]) -> Quantization | None:
    qc = raw.get("quantization_config")
    if qc is None and raw.get("dtype") == "fp8":  # the release's inference config
        require(
            raw.get("scale_fmt") == "ue8m0",
            "scale_fmt",
            f"must be 'ue8m0' (power-of-two scales), got {raw.get('scale_fmt')!r}",
        )
        return Quantization()
    if qc is None:
        return None
    check_fp8_quantization(qc)
    return Quantization()
