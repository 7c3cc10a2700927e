"""Model families, found by the checkpoint's HF `model_type` (like vLLM's model registry).

Each family is a package that exposes the same names, so the runtime (engine, scheduler, kv/,
runner, rank, services) never imports a model by name:

    ModelConfig.from_dir(dir)          the checkpoint's config.json, parsed and validated
                                       (`ConfigError` names the field): eos_token_ids,
                                       max_position_embeddings, quantization (None: dense),
                                       check_tensor_parallel(n, fp8) (refuses a group size that
                                       does not split the model, before any rank starts)
    the config as a KVModel            (engine.kv.layout) what sizes and lays out the pools:
                                       `family` (named in the layout and its hash, so two
                                       families never pair), kv_groups() (layers per page
                                       allocator, tokens per entry, index keys or not),
                                       compressor_rings() (slab state per request), the row
                                       widths, sliding_window (ring pages; 0: none),
                                       needs_scratch_rows, kv_layout_fields()
    build_model(cfg, dtype, device, quantized, tp)
                                       the module in its run-time dtypes, this rank's shard,
                                       weights not yet loaded (quantized: keep an FP8/FP4
                                       checkpoint's formats); what the runner calls
                                       (engine.runner.Model: `model(pool, StepInputs, rows)` ->
                                       fp32 logits); it reads and writes its own KV state
                                       through engine.step.StepState
    load_weights(model, dir)           fill it from the checkpoint's safetensors
                                       (engine.models.loading)
    tiny.make_tiny_model(dir, ...)     a tiny random checkpoint: `dsaserve make-tiny-model
                                       --model-type`, the tests, the benches' slices

Members a family may need and the others answer trivially (DeepSeek-V4.1 needs each):

    KVModel.kv_cache_dtypes            the --kv-cache-dtype values its pools can store; another
                                       is refused at start
    KVModel.prefill_halo               rows before a position whose state must be exact that
                                       prefill must compute in every layer (0: every row); the
                                       scheduler then names each chunk's anchors that far ahead
                                       (RowSpan.anchors: where the request samples, where the
                                       prefix cache may checkpoint)
    KVModel.token_lookback             token ids before a step's first row of a request that
                                       its rows read (RowSpan.lookback, StepInputs.lookback),
                                       also in decode graphs
    Model.cuda_graphs                  whether a decode step may be captured (it reads nothing
                                       back to the host); the rank captures none otherwise
    Model.counters()                   cumulative counts the worker exports as Prometheus
                                       counters

A draft head (optional; engine.speculative.draft_head reads it): the config's `mtp_layer_types`
(MTP layers) or `dspark` (engine.speculative.dspark_spec), `draft_layers` (set when
speculating: those layers' KV lives in the pools) and `draft_kind`; the model is then an
engine.runner.DraftModel (`run`, `draft`) or a BlockDraftModel (every forward writes the draft
layers' context; `draft_block`, its attention honouring StepInputs.block).

The torch-free side reads checkpoints too: engine.model_dir (a vision-language checkpoint's
language fields, `language_config`) and engine.text.chat_format (the chat format by
`model_type`). Families are imported on first use, so this module stays torch-free.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from dsaserve.engine.model_dir import ConfigError, read_config

FAMILIES = {
    "deepseek_v4": "dsaserve.engine.models.deepseek_v4",
    "deepseek_v32": "dsaserve.engine.models.deepseek_v32",
    "deepseek_v41": "dsaserve.engine.models.deepseek_v41",
}


def family(model_dir: str | os.PathLike) -> ModuleType:
    """The package that serves the checkpoint in `model_dir`."""
    model_type = read_config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json field `model_type`: {model_type!r} is not served here; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type])
