"""Which draft head a checkpoint carries, and whether the flag asks for that one: the checks that
give a clear error at start, and the config whose pools hold the head's KV state.

A family's config says what it carries: `mtp_layer_types` (its MTP layers, DeepSeek-V4's
`num_nextn_predict_layers`) or `dspark` (a DSparkSpec, engine.speculative.dspark_spec: the head
under the same `mtp.*` names). A config that can keep draft state in its pools has
`draft_layers` (how many draft layers' attention keep it) and `draft_kind`. A method that does
not match the checkpoint's head, a standalone drafter, or a head whose tensors the checkpoint
lacks is refused before anything is served, naming what was found: a DSpark head read as an MTP
layer drafts nothing that is ever accepted, and nobody would notice.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

from dsaserve.engine.model_dir import ConfigError, read_config
from dsaserve.engine.speculative.config import DSPARK, MTP, SpeculativeConfig
from dsaserve.engine.speculative.dspark_spec import DSparkSpec

C = TypeVar("C")


def draft_config(
    cfg: C, spec: SpeculativeConfig, model_dir: str | os.PathLike
) -> tuple[C, SpeculativeConfig]:
    """`cfg` with its draft head's layers in the pools, and `spec` with its drafts per step
    resolved (DSpark: the checkpoint's block size unless the flag says); ConfigError when the
    checkpoint in `model_dir` cannot draft as asked."""
    family = getattr(cfg, "family", "?")
    if spec.model is not None and os.path.realpath(spec.model) != os.path.realpath(model_dir):
        _refuse_standalone(spec)
    if not hasattr(cfg, "draft_layers"):
        raise ConfigError(
            f"--speculative-config method {spec.method!r}: the {family} family's draft head is "
            "not run here (speculative decoding serves DeepSeek-V4's MTP layer and DSpark head)"
        )
    dspark: DSparkSpec | None = getattr(cfg, "dspark", None)
    if spec.method == MTP:
        if dspark is not None:
            raise ConfigError(
                "--speculative-config method 'mtp': this checkpoint's draft head is DSpark "
                f"(config.json sets {', '.join(DSparkSpec.declared(_raw(model_dir)))}), not an "
                'MTP layer; use \'{"method": "dspark"}\''
            )
        if not getattr(cfg, "mtp_layer_types", ()):
            raise ConfigError(
                "--speculative-config method 'mtp' needs the checkpoint's MTP layer, "
                "and config.json declares none (num_nextn_predict_layers is 0)"
            )
        return dataclasses.replace(cfg, draft_layers=1), spec  # type: ignore[type-var]
    assert spec.method == DSPARK
    if dspark is None:
        has_mtp = bool(getattr(cfg, "mtp_layer_types", ()))
        raise ConfigError(
            "--speculative-config method 'dspark': config.json declares no DSpark head (none of "
            "dspark_block_size, dspark_markov_rank, dspark_noise_token_id, "
            "dspark_target_layer_ids)"
            + ("; its draft head is an MTP layer: use method 'mtp'" if has_mtp else "")
        )
    gamma = spec.num_speculative_tokens or dspark.block_size
    if gamma > dspark.block_size:
        raise ConfigError(
            f"--speculative-config num_speculative_tokens {gamma}: the checkpoint's DSpark head "
            f"drafts blocks of at most {dspark.block_size} (dspark_block_size)"
        )
    return (
        dataclasses.replace(cfg, draft_layers=dspark.num_layers),  # type: ignore[type-var]
        spec.with_drafts(gamma),
    )


def _raw(model_dir: str | os.PathLike) -> dict[str, Any]:
    raw = read_config(model_dir)
    return raw.get("text_config") or raw


def _refuse_standalone(spec: SpeculativeConfig) -> None:
    """A separate drafter checkpoint (vLLM's `model`): refused, saying what it is."""
    assert spec.model is not None
    try:
        raw = read_config(spec.model)
    except ConfigError:
        raw = {}
    if raw.get("speculators_model_type") == "dspark":
        raise ConfigError(
            f"--speculative-config model {spec.model!r} is a `speculators` DSpark drafter "
            "(speculators_model_type: dspark), whose block slot j predicts anchor + j where "
            "DeepSeek's heads predict anchor + j + 1: read as a bundled head every draft would "
            "be one position off and almost never accepted. It is not served; serve a "
            "checkpoint that bundles its head (config.json's dspark_* fields)"
        )
    raise ConfigError(
        f"--speculative-config model {spec.model!r}: standalone drafters are not served; the "
        "draft head is the checkpoint's own (leave `model` out)"
    )


def check_loaded(model: Any, model_dir: str, spec: SpeculativeConfig) -> None:
    """After loading: the draft head's tensors were in the checkpoint (the loader drops a draft
    head of which the checkpoint stores no tensor)."""
    if spec.method == MTP and not len(getattr(model, "mtp", ())):
        raise ConfigError(
            f"--speculative-config method 'mtp': the checkpoint in {model_dir} stores no MTP "
            "tensors (mtp.0.*; HF transformers' save_pretrained drops them), so there is "
            "nothing to draft with"
        )
    if spec.method == DSPARK and getattr(model, "dspark", None) is None:
        raise ConfigError(
            f"--speculative-config method 'dspark': the checkpoint in {model_dir} stores no "
            "DSpark head tensors (mtp.*: its draft layers, main_proj, markov_head), so there is "
            "nothing to draft with"
        )
