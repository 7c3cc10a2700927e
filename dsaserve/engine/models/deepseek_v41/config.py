"""DeepSeek-V4.1 model configuration, read from a checkpoint's HF `config.json`.

V4.1 is a vision-language checkpoint: config.json holds `model_type: deepseek_v41`, the
`quantization_config`, and the language model's fields nested in `text_config` (a config with
them at the top level is read the same way); `vision_config` describes the vision tower, which is
not served (images are refused by the chat formats). The fields (shared/reference/v41-dspark.md
section 1.3; DeepSeek's inference/config.json carries the same under its own names):

- 40 layers; `compress_ratios` one entry per layer (0: sliding window only; 1: a compressed
  entry per token; 2: one per two tokens), then trailing zeros for the DSpark head's layers
  (which must be zeros: anything else there is refused rather than guessed at).
- CSA2: only `kv_source_layer_ids` compress KV; every other compressed layer reads the entries
  of the latest source at or below it (of its ratio). `index_source_layer_ids` run an indexer;
  the others reuse the latest one's picks. `candidate_source_layer_id` picks
  `candidate_topk_blocks` blocks of `candidate_block_size` entries; later index sources pick
  their top `index_topk` inside them (DeepSeek's inference/model.py: `kv_source_layers`,
  `index_source_layers`, `candidate_source_layer`).
- The layers after the last KV source own nothing but their window: the "decoder" half, which
  prefill runs on a bounded number of rows before each position whose state must be exact
  (`halo`, engine.models.deepseek_v41.model).
- Engram n-gram tables on `engram_layer_ids` (engine.models.deepseek_v41.engram).
- MoE: sqrt-softplus scores with a selection bias on every layer (`topk_method: noaux_tc`, no
  hash-routed layers); FP8 weights in 32 x 32 blocks (activations quantized per 32), FP4 experts.
- No MTP layer: `num_nextn_predict_layers` and `dspark_*` describe the DSpark draft head, read
  into `dspark` (engine.speculative.dspark_spec, as V4's) and loaded by nobody yet: this config
  has no `draft_layers`, so speculative decoding refuses the family (the seam a V4.1 DSpark
  drafter fills: draft layers in the pools, the head's tensors under `mtp.*`).

A config this engine cannot serve raises ConfigError naming the field.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.kv.layout import LayerGroup, Ring
from dsaserve.engine.layers.rope import RopeSpec
from dsaserve.engine.model_dir import (
    check_fp8_quantization,
    check_split,
    get_field,
    language_config,
    read_config,
    require,
)
from dsaserve.engine.models.deepseek_v4.config import MOE, Quantization, rope_specs
from dsaserve.engine.speculative.dspark_spec import DSparkSpec

MODEL_TYPE = "deepseek_v41"
FP8_BLOCK = 32  # V4.1's FP8 weight tiles (32 x 32) and activation groups
RATIOS = (0, 1, 2)
SWA = "swa"  # the pool group of the layers that keep only their window (no entries of their own)


def entry_group(ratio: int) -> str:
    """The pool group of the KV sources of one compress ratio: their window, entries, index keys."""
    return f"comp{ratio}"


@dataclass(frozen=True)
class EngramConfig:
    """Engram's fields (DeepSeek's inference/engram.py reads the same)."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # table rows, per Engram layer
    max_ngram_size: int  # n-grams of 2 .. max_ngram_size tokens end at each position
    n_heads: int  # hash heads per n-gram size
    head_dim: int  # width of a table row
    vocab_size: int  # each (n-gram size, head) draws a prime above it
    compressed_vocab_size: int  # the normalized token map's size (every multiplier derives from it)
    pad_token_id: int  # fills the n-gram slots before the sequence's start

    @property
    def lookback(self) -> int:
        """Tokens before a position its n-grams read."""
        return self.max_ngram_size - 1

    @property
    def hash_cols(self) -> int:
        """Rows one position looks up per Engram layer."""
        return (self.max_ngram_size - 1) * self.n_heads


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
    compress_ratios: tuple[int, ...]  # per layer
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int  # -1: no candidate level
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_main: RopeSpec
    rope_compress: RopeSpec
    engram: EngramConfig | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # the DSpark head the checkpoint bundles (mtp.*), read and checked as V4's is; not run here:
    # the config has no draft_layers, so speculative decoding refuses this family
    dspark: DSparkSpec | None
    quantization: Quantization | None  # None: a dense checkpoint

    # ---------------------------------------------------------------- topology

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int:
        """The layer whose compressed entries a compressed `layer` reads (itself if a source)."""
        return self.kv_sources[bisect.bisect_right(self.kv_sources, layer) - 1]

    def index_source_of(self, layer: int) -> int:
        """The layer whose indexer picks a compressed `layer`'s entries (itself if a source)."""
        return self.index_sources[bisect.bisect_right(self.index_sources, layer) - 1]

    def uses_candidates(self, layer: int) -> bool:
        """Whether `layer`'s indexer picks inside the candidate source's blocks."""
        return 0 <= self.candidate_source < layer and layer in self.index_sources

    @property
    def last_kv_source(self) -> int:
        return self.kv_sources[-1] if self.kv_sources else -1

    def halo(self, layer: int) -> int | None:
        """Rows before a position p whose input to `layer` prefill must compute for the state at p
        to be exact; None: every row (the layers up to the last KV source, whose entries every
        later row reads).

        A layer past the last KV source keeps only its window, so its state at p is its window
        rows of [p - W + 1, p) (what a decode at p reads) and, for the last layer, the logits of
        p - 1. Its output at a row needs its window KV of the W - 1 rows before, which needs its
        input there: each layer back needs W - 1 rows more. So the last layer needs W rows of
        input, each layer before it W - 1 more (V4.1-Flash: 128 at layer 39, 2,414 at layer 21;
        vLLM's PR #57281 computes the same "dependency-preserving halo"), and the last KV
        source's attention and MoE output only those of the first layer after it."""
        if layer <= self.last_kv_source:
            return None
        w = self.sliding_window
        return w + (self.num_layers - 1 - layer) * (w - 1)

    def out_halo(self, layer: int) -> int | None:
        """Rows before such a position whose OUTPUT of `layer` prefill computes: the next layer's
        input (the last layer's: the logits row)."""
        if layer < self.last_kv_source:
            return None
        return 1 if layer == self.num_layers - 1 else self.halo(layer + 1)

    def mlp_kind(self, layer: int) -> str:
        return MOE  # (engine.models.deepseek_v4.moe: every V4.1 layer routes by score)

    # ---------------------------------------------------------------- engine.kv.layout.KVModel

    @property
    def family(self) -> str:
        return MODEL_TYPE

    @property
    def needs_scratch_rows(self) -> bool:
        return True  # a step's rows attend before they persist to the window ring

    @property
    def kv_cache_dtypes(self) -> tuple[str, ...]:
        # FP8 pages would store V4's formats (584-byte rows, e4m3 index keys); V4.1's own (its
        # QAT: MXFP8 window rows, NVFP4 entries, MXFP4 index keys) are not implemented
        return ("auto",)

    @property
    def prefill_halo(self) -> int:
        """The widest halo (engine.kv.layout.KVModel): how far ahead of a chunk a position may lie
        whose state the chunk's rows feed."""
        return max((h for i in range(self.num_layers) if (h := self.halo(i))), default=0)

    @property
    def token_lookback(self) -> int:
        """Tokens before a step's first row of a request that its rows read (Engram's n-grams)."""
        return self.engram.lookback if self.engram else 0

    def kv_groups(self) -> tuple[LayerGroup, ...]:
        """The layers with a window only (no entries of their own: sliding layers and the CSA2
        layers that read a source's entries), then each ratio's KV sources (window, entries and
        the indexer's keys, which only sources compute), ratio 2 first."""
        sources = set(self.kv_sources)
        groups = [
            LayerGroup(SWA, tuple(i for i in range(self.num_layers) if i not in sources), 0, False)
        ]
        for ratio in sorted({self.compress_ratios[s] for s in sources}, reverse=True):
            layers = tuple(s for s in self.kv_sources if self.compress_ratios[s] == ratio)
            groups.append(LayerGroup(entry_group(ratio), layers, ratio, True))
        return tuple(g for g in groups if g.layers)

    def compressor_rings(self) -> tuple[Ring, ...]:
        """A ratio-2 source's raw (kv, score) of its last two positions (an even one waits for
        its pair; engine.models.deepseek_v41.compressor). Ratio 1 pools nothing."""
        return tuple(
            Ring(s, "comp", self.compress_ratios[s], self.head_dim)
            for s in self.kv_sources
            if self.compress_ratios[s] > 1
        )

    def kv_layout_fields(self) -> dict[str, object]:
        return {
            "compress_ratios": list(self.compress_ratios),
            "kv_sources": list(self.kv_sources),
            "index_sources": list(self.index_sources),
        }

    def check_tensor_parallel(self, size: int, fp8: bool) -> None:
        """Raise ConfigError unless `size` ranks split the model as the release does (query heads
        and output groups, routed experts, the vocabulary); with FP8 weights kept, wq_b's output
        and wo_b's input of a rank must fall on the 32 x 32 block grid."""
        if size == 1:
            return
        check_split(
            size,
            (
                ("num_attention_heads", self.num_heads),
                ("o_groups", self.o_groups),
                ("n_routed_experts", self.num_experts),
                ("vocab_size", self.vocab_size),
            ),
            (
                ("wq_b's output rows", self.num_heads // size * self.head_dim),
                ("wo_b's input", self.o_groups // size * self.o_lora_rank),
            )
            if fp8
            else (),
            block=FP8_BLOCK,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        return cls.from_hf(read_config(model_dir))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(dict(raw))


def _layer_list(raw: dict[str, Any], field: str, n: int) -> tuple[int, ...]:
    value = get_field(raw, field, [], list)
    require(
        all(isinstance(i, int) and 0 <= i < n for i in value) and value == sorted(set(value)),
        field,
        f"must be ascending distinct layer indices below num_hidden_layers ({n}), got {value}",
    )
    return tuple(value)


def _topology(raw: dict[str, Any], n: int) -> dict[str, Any]:
    ratios = get_field(raw, "compress_ratios", None, list)
    require(len(ratios) >= n, "compress_ratios", f"has {len(ratios)} entries for {n} layers")
    bad = [r for r in ratios[:n] if r not in RATIOS]
    require(not bad, "compress_ratios", f"entries must be 0, 1 or 2 for DeepSeek-V4.1, got {bad}")
    require(
        not any(ratios[n:]),
        "compress_ratios",
        f"entries past the {n} layers (the DSpark head's) must be 0, got {ratios[n:]}",
    )
    kv = _layer_list(raw, "kv_source_layer_ids", n)
    index = _layer_list(raw, "index_source_layer_ids", n)
    for field, layers in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        zero = [i for i in layers if ratios[i] == 0]
        require(not zero, field, f"layers {zero} compress nothing (compress_ratios 0)")
    require(
        set(kv) <= set(index),
        "kv_source_layer_ids",
        "every KV source must also run an indexer (its keys come from its entries)",
    )
    for layer in range(n):
        if not ratios[layer]:
            continue
        for field, layers in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
            below = [s for s in layers if s <= layer]
            require(
                bool(below) and ratios[below[-1]] == ratios[layer],
                field,
                f"layer {layer} (ratio {ratios[layer]}) reads the latest source at or below it, "
                f"which must have its ratio; found {below[-1:] or 'none'}",
            )
    candidate = get_field(raw, "candidate_source_layer_id", -1, int)
    blocks = get_field(raw, "candidate_topk_blocks", 0, int)
    block_size = get_field(raw, "candidate_block_size", 0, int)
    topk = get_field(raw, "index_topk", 512, int)
    if candidate >= 0:
        require(candidate in index, "candidate_source_layer_id", "must be an index source")
        # With fewer candidates than picks, the release's top-k would take masked entries, in an
        # order its tie-breaking decides: refused rather than served differently.
        require(
            blocks > 0 and block_size > 0 and blocks * block_size >= topk,
            "candidate_topk_blocks",
            f"candidate_topk_blocks x candidate_block_size must be >= index_topk ({topk})",
        )
    return dict(
        compress_ratios=tuple(ratios[:n]),
        kv_sources=kv,
        index_sources=index,
        candidate_source=candidate,
        candidate_topk_blocks=blocks,
        candidate_block_size=block_size,
        index_topk=topk,
    )


def _engram(raw: dict[str, Any], n: int) -> EngramConfig | None:
    layers = _layer_list(raw, "engram_layer_ids", n)
    if not layers:
        return None
    rows = get_field(raw, "engram_num_embeddings", None, list)
    require(len(rows) == len(layers), "engram_num_embeddings", "needs one entry per Engram layer")
    cfg = EngramConfig(
        layer_ids=layers,
        num_embeddings=tuple(int(r) for r in rows),
        max_ngram_size=get_field(raw, "engram_max_ngram_size", None, int),
        n_heads=get_field(raw, "engram_n_heads", None, int),
        head_dim=get_field(raw, "engram_head_dim", None, int),
        vocab_size=get_field(raw, "engram_vocab_size", None, int),
        compressed_vocab_size=get_field(raw, "engram_compressed_vocab_size", None, int),
        pad_token_id=get_field(raw, "engram_pad_token_id", 2, int),
    )
    require(cfg.max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
    require(
        cfg.head_dim % FP8_BLOCK == 0,
        "engram_head_dim",
        f"must be a multiple of {FP8_BLOCK} (a table row's FP8 scale groups)",
    )
    return cfg


def _quantization(raw: dict[str, Any]) -> Quantization | None:
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    check_fp8_quantization(qc, FP8_BLOCK)
    experts = qc.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
    require(experts == "fp4", "quantization_config.expert_dtype", f"must be 'fp4', got {experts!r}")
    return Quantization(expert_dtype=experts, block=FP8_BLOCK)


def _parse(top: dict[str, Any]) -> ModelConfig:
    model_type = top.get("model_type")
    require(model_type == MODEL_TYPE, "model_type", f"must be {MODEL_TYPE!r}, got {model_type!r}")
    raw = dict(language_config(top))
    n = get_field(raw, "num_hidden_layers", None, int)
    require(n >= 1, "num_hidden_layers", "must be >= 1")
    require(
        get_field(raw, "num_key_value_heads", 1, int) == 1,
        "num_key_value_heads",
        "DeepSeek-V4.1 attention shares one K=V head; must be 1",
    )
    heads = get_field(raw, "num_attention_heads", None, int)
    head_dim = get_field(raw, "head_dim", None, int)
    rope_dim = get_field(raw, "qk_rope_head_dim", None, int)
    require(
        0 < rope_dim <= head_dim and rope_dim % 2 == 0,
        "qk_rope_head_dim",
        "must be even, <= head_dim",
    )
    o_groups = get_field(raw, "o_groups", None, int)
    require(heads % o_groups == 0, "o_groups", f"must divide num_attention_heads ({heads})")
    hidden = get_field(raw, "hidden_size", None, int)
    moe_inter = get_field(raw, "moe_intermediate_size", None, int)
    for field, value in (("hidden_size", hidden), ("moe_intermediate_size", moe_inter)):
        require(value % 8 == 0, field, f"must be a multiple of 8, got {value}")
    num_experts = get_field(raw, "n_routed_experts", None, int)
    top_k = get_field(raw, "num_experts_per_tok", None, int)
    # (the release leaves a top-1 routing weight unnormalized, which V4's router does not serve)
    require(2 <= top_k <= num_experts, "num_experts_per_tok", f"must be in [2, {num_experts}]")
    require(raw.get("n_shared_experts", 1) == 1, "n_shared_experts", "must be 1")
    require(raw.get("norm_topk_prob", True) is True, "norm_topk_prob", "must be true")
    require(raw.get("hidden_act", "silu") == "silu", "hidden_act", "only 'silu' is supported")
    method = raw.get("topk_method", "noaux_tc")
    require(method == "noaux_tc", "topk_method", f"must be 'noaux_tc', got {method!r}")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    require(
        scoring in ("sqrtsoftplus", "sigmoid"),
        "scoring_func",
        f"must be 'sqrtsoftplus' or 'sigmoid', got {scoring!r}",
    )
    eos = raw.get("eos_token_id", top.get("eos_token_id", 1))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_main, rope_compress = rope_specs(raw)
    return ModelConfig(
        vocab_size=get_field(raw, "vocab_size", None, int),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=get_field(raw, "q_lora_rank", None, int),
        o_groups=o_groups,
        o_lora_rank=get_field(raw, "o_lora_rank", None, int),
        sliding_window=get_field(raw, "sliding_window", 128, int),
        **_topology(raw, n),
        index_n_heads=get_field(raw, "index_n_heads", None, int),
        index_head_dim=get_field(raw, "index_head_dim", None, int),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        routed_scaling_factor=float(get_field(raw, "routed_scaling_factor", 1.5, (int, float))),
        scoring_func=scoring,
        swiglu_limit=float(get_field(raw, "swiglu_limit", 10.0, (int, float))),
        hc_mult=get_field(raw, "hc_mult", 4, int),
        hc_sinkhorn_iters=get_field(raw, "hc_sinkhorn_iters", 20, int),
        hc_eps=float(get_field(raw, "hc_eps", 1e-6, (int, float))),
        rms_norm_eps=float(get_field(raw, "rms_norm_eps", 1e-20, (int, float))),
        max_position_embeddings=get_field(raw, "max_position_embeddings", 1048576, int),
        rope_main=rope_main,
        rope_compress=rope_compress,
        engram=_engram(raw, n),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", top.get("bos_token_id")),
        eos_token_ids=eos_ids,
        dspark=DSparkSpec.from_config(raw, n, get_field(raw, "vocab_size", None, int)),
        quantization=_quantization({**raw, **top}),
    )
