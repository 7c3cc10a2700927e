"""DeepSeek-V4 model configuration, read from a checkpoint's HF `config.json`.

Accepts the field names HF transformers' `DeepseekV4Config` accepts, legacy ones included
(`compress_ratios`, `compress_rate_csa`/`compress_rate_hca`, `num_hash_layers`,
`qk_rope_head_dim`, a flat `rope_scaling`/`rope_parameters`), and the release's quantization
fields (`quantization_config`, top-level `expert_dtype`). A config this engine cannot serve
raises `ConfigError` naming the field.

Layer indices past `num_layers` are the draft head's: the multi-token-prediction (MTP) layers, as
in the release (`compress_ratios` has one entry per layer and then one per MTP layer), or a DSpark
head's draft layers (`dspark_*` fields, engine.speculative.dspark_spec), sliding-window only.
"""

from __future__ import annotations

import dataclasses
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
from dsaserve.engine.speculative.dspark_spec import DSparkSpec

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
KV_GROUP = {SLIDING: "swa", CSA: "csa", HCA: "hca"}  # each kind's KV pool group
HASH_MOE, MOE = "hash_moe", "moe"
MODEL_TYPE = "deepseek_v4"


@dataclass(frozen=True)
class Quantization:
    """How a quantized checkpoint stores its linear weights (the release's formats).

    FP8 e4m3 weights with one ue8m0 scale per block x block tile (`<name>.scale`), activations
    quantized per `block` values; routed experts either FP4 (e2m1 pairs in int8 [out, in/2], one
    ue8m0 scale per 32 inputs) or FP8 like the rest. Norms, router, head, embeddings and
    compressor projections stay dense. (DeepSeek-V4.1's format is this one with 32-blocks.)"""

    expert_dtype: str  # "fp4" | "fp8"
    block: int = FP8_BLOCK


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    mlp_layer_types: tuple[str, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_main: RopeSpec
    rope_compress: RopeSpec
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # attention kind of each draft layer (layer num_layers + i): the MTP layers, or a DSpark
    # head's (all sliding)
    mtp_layer_types: tuple[str, ...]
    quantization: Quantization | None  # None: a dense (bf16/fp32) checkpoint
    dspark: DSparkSpec | None = None  # the DSpark head the checkpoint bundles (mtp.* is it)
    # draft layers whose attention keeps KV state in the pools (speculative decoding runs them)
    draft_layers: int = 0

    @property
    def draft_kind(self) -> str:
        """The checkpoint's draft head: "dspark" or "mtp" (engine.speculative.config's)."""
        return "dspark" if self.dspark is not None else "mtp"

    def attention_kind(self, layer: int) -> str:
        """The attention kind of `layer`, MTP layers (num_layers + i) included."""
        return (self.layer_types + self.mtp_layer_types)[layer]

    def mlp_kind(self, layer: int) -> str:
        # The release hashes layer ids below n_hash_layers only: MTP layers route by score.
        return self.mlp_layer_types[layer] if layer < self.num_layers else MOE

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry for `layer` (0 for sliding-only layers)."""
        kind = self.attention_kind(layer)
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def layers_of(self, kind: str) -> list[int]:
        """The layers of attention kind `kind` that keep KV state (draft layers included)."""
        return [i for i, t in enumerate(self._kv_layer_types) if t == kind]

    @property
    def _kv_layer_types(self) -> tuple[str, ...]:
        return self.layer_types + self.mtp_layer_types[: self.draft_layers]

    # ---------------------------------------------------------------- engine.kv.layout.KVModel

    def kv_groups(self) -> tuple[LayerGroup, ...]:
        """A pool group per attention kind: sliding, CSA (with the indexer's keys), HCA."""
        return tuple(
            LayerGroup(KV_GROUP[kind], tuple(layers), self.compress_rate(layers[0]), kind == CSA)
            for kind in LAYER_TYPES
            if (layers := self.layers_of(kind))
        )

    def compressor_rings(self) -> tuple[Ring, ...]:
        """Each compressed layer's rings, layer by layer: its compressor's, then (CSA) its
        indexer's. An overlapping (CSA) compressor keeps 2 windows of [Ca | Cb] features."""
        rings = []
        for i, kind in enumerate(self._kv_layer_types):
            rate = self.compress_rate(i)
            widths = {CSA: (("comp", self.head_dim), ("index", self.index_head_dim))}.get(
                kind, (("comp", self.head_dim),) if kind == HCA else ()
            )
            for name, width in widths:
                rows, features = (2 * rate, 2 * width) if kind == CSA else (rate, width)
                rings.append(Ring(i, name, rows, features))
        return tuple(rings)

    @property
    def family(self) -> str:
        return MODEL_TYPE

    @property
    def needs_scratch_rows(self) -> bool:
        return True  # a step's rows attend before they persist to the window ring

    kv_cache_dtypes = ("auto", "fp8")
    prefill_halo = 0  # (every row is computed)
    token_lookback = 0

    def kv_layout_fields(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "layer_types": list(self.layer_types),
            "compress_rates": self.compress_rates,
        }
        if self.draft_layers:
            fields["mtp_layer_types"] = list(self.mtp_layer_types[: self.draft_layers])
            if self.dspark is not None:  # (an MTP layer's pages mean other bytes)
                fields["draft_head"] = "dspark"
        return fields

    def check_tensor_parallel(self, size: int, fp8: bool) -> None:
        """Raise ConfigError unless `size` ranks can split this model as the release does:
        query heads and output groups by rank, routed experts in contiguous ranges, the
        vocabulary in equal parts; with FP8 weights kept (`fp8`), every split of wq_b's
        output and of wo_b's input also falls on the 128x128 block grid of their scales."""
        if size == 1:
            return
        heads, groups = self.num_heads // size, self.o_groups // size
        check_split(
            size,
            (
                ("num_attention_heads", self.num_heads),
                ("o_groups", self.o_groups),
                ("n_routed_experts", self.num_experts),
                ("vocab_size", self.vocab_size),
            ),
            (
                ("wq_b's output rows (heads x head_dim)", heads * self.head_dim),
                ("wo_b's input (o_groups x o_lora_rank)", groups * self.o_lora_rank),
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
        return _parse(dict(raw))


def _layer_types(
    raw: dict[str, Any], n: int, n_mtp: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(kinds of the n layers, kinds of the n_mtp MTP layers: sliding where the config has no
    entry for them)."""
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
        field = "layer_types"
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        bad = [r for r in ratios if r not in _RATIO_TO_LAYER_TYPE]
        require(not bad, "compress_ratios", f"entries must be 0, 4 or 128, got {bad}")
        types, field = [_RATIO_TO_LAYER_TYPE[r] for r in ratios], "compress_ratios"
    else:  # HF's default schedule: two HCA layers, then CSA/HCA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        field = "layer_types"
    require(len(types) >= n, field, f"has {len(types)} entries for {n} layers")
    types = types[: n + n_mtp] + [SLIDING] * max(0, n + n_mtp - len(types))
    bad = [t for t in types if t not in LAYER_TYPES]
    require(not bad, field, f"entries must be one of {LAYER_TYPES}, got {bad}")
    return tuple(types[:n]), tuple(types[n:])


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])
        require(len(types) >= n, "mlp_layer_types", f"has {len(types)} entries for {n} layers")
        bad = [t for t in types[:n] if t not in (HASH_MOE, MOE)]
        require(not bad, "mlp_layer_types", f"entries must be 'hash_moe' or 'moe', got {bad}")
        return tuple(types[:n])
    n_hash = raw.get("num_hash_layers", 3)
    require(
        isinstance(n_hash, int) and n_hash >= 0,
        "num_hash_layers",
        f"must be an int >= 0, got {n_hash!r}",
    )
    return tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))


def rope_specs(raw: dict[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    """(the sliding layers' plain table, the compressed layers' table: YaRN where configured),
    as DeepSeek-V4 and V4.1 read `rope_theta`, `compress_rope_theta` and the rope scaling."""
    theta = float(get_field(raw, "rope_theta", 10000.0, (int, float)))
    compress_theta = float(get_field(raw, "compress_rope_theta", 160000.0, (int, float)))
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    require(isinstance(params, dict), "rope_parameters", "must be an object")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:  # flat form: the scaling applies to the compressed layers only (as in HF)
        main = {"rope_type": "default", "rope_theta": theta}
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress.setdefault("rope_theta", compress_theta)
    return _rope_spec(main, theta, "rope_parameters.main"), _rope_spec(
        compress, compress_theta, "rope_parameters.compress"
    )


def _rope_spec(p: dict[str, Any], default_theta: float, field: str) -> RopeSpec:
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", default_theta))
    if kind == "default":
        return RopeSpec(theta=theta)
    require(
        kind == "yarn",
        f"{field}.rope_type",
        f"only 'default' and 'yarn' are supported, got {kind!r}",
    )
    # The V4 reference never scales cos/sin by YaRN's mscale (HF forces attention_factor=1).
    attention_factor = p.get("attention_factor", 1.0)
    require(
        attention_factor in (None, 1.0), f"{field}.attention_factor", "must be 1.0 for DeepSeek-V4"
    )
    require(
        "factor" in p and "original_max_position_embeddings" in p,
        field,
        "yarn needs `factor` and `original_max_position_embeddings`",
    )
    return RopeSpec(
        theta=theta,
        factor=float(p["factor"]),
        original_max_position=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
    )


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    require(model_type == MODEL_TYPE, "model_type", f"must be {MODEL_TYPE!r}, got {model_type!r}")
    n = get_field(raw, "num_hidden_layers", 43, int)
    require(n >= 1, "num_hidden_layers", "must be >= 1")
    n_mtp = get_field(raw, "num_nextn_predict_layers", 1, int)
    require(n_mtp >= 0, "num_nextn_predict_layers", "must be >= 0")
    layer_types, mtp_layer_types = _layer_types(raw, n, n_mtp)
    hidden = get_field(raw, "hidden_size", 4096, int)
    heads = get_field(raw, "num_attention_heads", 64, int)
    head_dim = get_field(raw, "head_dim", 512, int)
    require(
        get_field(raw, "num_key_value_heads", 1, int) == 1,
        "num_key_value_heads",
        "DeepSeek-V4 attention shares one K=V head; must be 1",
    )
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = int(raw["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
    require(
        0 < rope_dim <= head_dim and rope_dim % 2 == 0,
        "partial_rotary_factor",
        f"gives a rope dim of {rope_dim}; it must be even and within head_dim {head_dim}",
    )

    compress_rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if raw.get("compress_rate_csa") is not None:
        compress_rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        compress_rates[HCA] = int(raw["compress_rate_hca"])
    for kind in (CSA, HCA):
        require(
            isinstance(compress_rates.get(kind), int) and compress_rates[kind] >= 1,
            "compress_rates",
            f"needs a positive int for {kind!r}",
        )

    o_groups = get_field(raw, "o_groups", 8, int)
    require(heads % o_groups == 0, "o_groups", f"must divide num_attention_heads ({heads})")
    moe_inter = get_field(raw, "moe_intermediate_size", 2048, int)
    # Grouped GEMMs need 16-byte aligned rows for every dtype we run.
    for field, value in (("hidden_size", hidden), ("moe_intermediate_size", moe_inter)):
        require(value % 8 == 0, field, f"must be a multiple of 8, got {value}")
    num_experts = get_field(raw, "n_routed_experts", 256, int)
    top_k = get_field(raw, "num_experts_per_tok", 6, int)
    require(
        1 <= top_k <= num_experts,
        "num_experts_per_tok",
        f"must be in [1, n_routed_experts={num_experts}]",
    )
    require(
        raw.get("n_shared_experts", 1) == 1,
        "n_shared_experts",
        "DeepSeek-V4 has exactly one shared expert",
    )
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    require(
        scoring in ("sqrtsoftplus", "sigmoid"),
        "scoring_func",
        f"must be 'sqrtsoftplus' or 'sigmoid', got {scoring!r}",
    )
    require(
        raw.get("norm_topk_prob", True) is True,
        "norm_topk_prob",
        "only normalized top-k weights are supported",
    )
    require(raw.get("hidden_act", "silu") == "silu", "hidden_act", "only 'silu' is supported")
    for field in ("attention_bias", "mlp_bias"):
        require(not raw.get(field, False), field, "biases are not part of DeepSeek-V4")

    vocab = get_field(raw, "vocab_size", 129280, int)
    dspark = DSparkSpec.from_config(raw, n, vocab)
    if dspark is not None:  # its draft layers attend to a sliding window only
        mtp_layer_types = (SLIDING,) * dspark.num_layers
        # (V4.1's heads have a smaller MoE; V4's draft layers are built with the target's)
        for field, value, own in (
            ("dspark_n_routed_experts", dspark.num_experts, "n_routed_experts"),
            ("dspark_num_experts_per_tok", dspark.num_experts_per_tok, "num_experts_per_tok"),
        ):
            require(value in (None, raw.get(own, value)), field,
                    f"DeepSeek-V4's draft layers have the target's MoE ({own})")  # fmt: skip
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_main, rope_compress = rope_specs(raw)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=get_field(raw, "q_lora_rank", 1024, int),
        o_groups=o_groups,
        o_lora_rank=get_field(raw, "o_lora_rank", 1024, int),
        sliding_window=get_field(raw, "sliding_window", 128, int),
        layer_types=layer_types,
        compress_rates=compress_rates,
        mlp_layer_types=_mlp_layer_types(raw, n),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        routed_scaling_factor=float(get_field(raw, "routed_scaling_factor", 1.5, (int, float))),
        scoring_func=scoring,
        swiglu_limit=float(get_field(raw, "swiglu_limit", 10.0, (int, float))),
        hc_mult=get_field(raw, "hc_mult", 4, int),
        hc_sinkhorn_iters=get_field(raw, "hc_sinkhorn_iters", 20, int),
        hc_eps=float(get_field(raw, "hc_eps", 1e-6, (int, float))),
        index_n_heads=get_field(raw, "index_n_heads", 64, int),
        index_head_dim=get_field(raw, "index_head_dim", 128, int),
        index_topk=get_field(raw, "index_topk", 512, int),
        rms_norm_eps=float(get_field(raw, "rms_norm_eps", 1e-6, (int, float))),
        max_position_embeddings=get_field(raw, "max_position_embeddings", 1048576, int),
        rope_main=rope_main,
        rope_compress=rope_compress,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        mtp_layer_types=mtp_layer_types,
        quantization=_quantization(raw),
        dspark=dspark,
    )


def _quantization(raw: dict[str, Any]) -> Quantization | None:
    qc = raw.get("quantization_config")
    expert_dtype = raw.get("expert_dtype")
    if qc is None:
        require(
            expert_dtype is None,
            "expert_dtype",
            "quantized experts need the FP8 `quantization_config` of the release",
        )
        return None
    check_fp8_quantization(qc)
    # V4 writes expert_dtype at the top level, V4.1 inside quantization_config (as HF moves it).
    experts = qc.get("expert_dtype", expert_dtype) or "fp8"
    require(experts in ("fp4", "fp8"), "expert_dtype", f"must be 'fp4' or 'fp8', got {experts!r}")
    return Quantization(expert_dtype=experts)
