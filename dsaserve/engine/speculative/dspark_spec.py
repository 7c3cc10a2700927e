"""What a checkpoint's config says of its DSpark draft head (torch-free).

DSpark (DeepSeek's block-parallel drafter, shipped in DeepSeek-V4-Flash-0731, -V4-Flash-DSpark,
-V4-Pro-0813 and DeepSeek-V4.1) drafts a block of gamma tokens in one pass of a few draft layers,
reading the target through the hidden states of some of its layers. A checkpoint bundles one when
its config carries any of `dspark_block_size`, `dspark_markov_rank`, `dspark_noise_token_id` or
`dspark_target_layer_ids` (SGLang's test of a bundled head); its tensors then sit under `mtp.*`,
where an MTP checkpoint keeps its MTP layer, so the two must never be confused.

A family reads the fields from the dict that holds its text model's config (V4: the top level;
V4.1: `text_config`) with `DSparkSpec.from_config`; `ConfigError` names a wrong field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsaserve.engine.model_dir import get_field, require

MARKERS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id",
           "dspark_target_layer_ids")  # fmt: skip
DEFAULT_LAYERS = 3  # V4's and V4.1's heads (vLLM and SGLang assume it where the config is silent)
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec also trains "gated" and "rnn" heads: none shipped


@dataclass(frozen=True)
class DSparkSpec:
    block_size: int  # gamma: query rows of a draft block (the anchor + gamma - 1 noise tokens)
    markov_rank: int  # r of the low-rank Markov head (W1 [V, r], W2 [V, r])
    noise_token_id: int  # the token of the block's rows after the anchor
    target_layer_ids: tuple[int, ...]  # target layers whose hidden states the head reads
    num_layers: int  # draft layers (`mtp.0` .. `mtp.{num_layers - 1}`)
    # the draft layers' MoE when it differs from the target's (V4.1: 128 experts, top-3)
    num_experts: int | None = None
    num_experts_per_tok: int | None = None

    @staticmethod
    def declared(raw: dict[str, Any]) -> list[str]:
        """The DSpark markers `raw` sets (empty: no DSpark head)."""
        return [k for k in MARKERS if raw.get(k) is not None]

    @classmethod
    def from_config(
        cls, raw: dict[str, Any], num_layers: int, vocab_size: int
    ) -> DSparkSpec | None:
        """The head `raw` (a text model's config) declares, checked against the target's
        `num_layers` and `vocab_size`; None when it declares none."""
        if not cls.declared(raw):
            return None
        for name in MARKERS:
            require(raw.get(name) is not None, name, f"a DSpark head needs all of {MARKERS}")
        block = get_field(raw, "dspark_block_size", kind=int)
        rank = get_field(raw, "dspark_markov_rank", kind=int)
        noise = get_field(raw, "dspark_noise_token_id", kind=int)
        require(block >= 1, "dspark_block_size", f"must be >= 1, got {block}")
        require(rank >= 1, "dspark_markov_rank", f"must be >= 1, got {rank}")
        require(0 <= noise < vocab_size, "dspark_noise_token_id",
                f"{noise} is outside the vocabulary [0, {vocab_size})")  # fmt: skip
        taps = raw["dspark_target_layer_ids"]
        ordered = isinstance(taps, list) and bool(taps) and all(type(t) is int for t in taps)
        ordered = ordered and taps == sorted(set(taps)) and 0 <= taps[0] and taps[-1] < num_layers
        require(
            ordered,
            "dspark_target_layer_ids",
            f"must be strictly increasing layer ids in [0, {num_layers}), got {taps!r}",
        )
        kind = raw.get("dspark_markov_head_type") or "vanilla"
        require(kind in MARKOV_HEAD_TYPES, "dspark_markov_head_type",
                f"{kind!r} is not served; supported: {', '.join(MARKOV_HEAD_TYPES)}")  # fmt: skip
        layers = get_field(raw, "dspark_num_layers", DEFAULT_LAYERS, int)
        require(layers >= 1, "dspark_num_layers", f"must be >= 1, got {layers}")
        experts = raw.get("dspark_n_routed_experts")
        top_k = raw.get("dspark_num_experts_per_tok")
        return cls(block, rank, noise, tuple(taps), layers, experts, top_k)
