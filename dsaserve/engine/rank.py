"""What every rank of an engine builds from a checkpoint: its shard of the model, its KV pool and
its runner, with the decode steps captured as CUDA graphs; and what a follower rank (ranks
1..N-1 of a tensor-parallel group) then runs: every call rank 0 sends (`follower_main`).

Rank 0 (`LLMEngine`) and each follower rank call `build_runner` with the same settings, so the
collectives inside it line up across the group: the smallest KV budget of any rank (every rank's
pools must have the same layout: rank 0 allocates pages, the others replay its page tables),
then the warm-up steps of the graph captures, in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Protocol

import torch
import torch.distributed as dist

from dsaserve.engine import models
from dsaserve.engine.config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from dsaserve.engine.kv.layout import (
    SEQUENCE_SHARE,
    KVCacheConfig,
    KVModel,
    checkpoint_bytes,
    default_checkpoint_rows,
    fit_max_num_seqs,
    sequence_bytes,
)
from dsaserve.engine.kv.pool import KVPool
from dsaserve.engine.parallel.channel import Channel
from dsaserve.engine.parallel.group import TensorParallel
from dsaserve.engine.parallel.launch import World, join_follower
from dsaserve.engine.prefix_cache.host_tier import HostTier
from dsaserve.engine.runner import Model, ModelRunner
from dsaserve.engine.simulate import CostModel, SimulatedModel
from dsaserve.engine.speculative.draft_head import check_loaded, draft_config
from dsaserve.engine.text.tokenizer import Tokenizer

DEFAULT_CPU_KV_BYTES = 512 << 20
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

log = logging.getLogger(__name__)


class Quantized(Protocol):
    """A family's config, as far as keeps_quantized reads it."""

    @property
    def quantization(self) -> object | None: ...  # None: a dense checkpoint


def device_of(config: EngineConfig, rank: int) -> torch.device:
    """Global rank r of a group on GPUs uses its node's (r - first rank there)-th visible GPU."""
    device = torch.device(config.device)
    if device.type == "cuda" and config.tensor_parallel_size * config.data_parallel_size > 1:
        return torch.device("cuda", config.local_index(rank))
    return device


def world_of(config: EngineConfig) -> World:
    """Where the engine of `config` sits among every rank of its data-parallel group."""
    return World(
        config.tensor_parallel_size,
        config.data_parallel_size,
        config.data_parallel_rank,
        config.enable_expert_parallel,
        config.master_addr,
        config.master_port,
    )


def keeps_quantized(config: EngineConfig, model_config: Quantized) -> bool:
    """Whether FP8/FP4 weights stay quantized: as asked, or by default for bfloat16 (the
    release computes in bf16 with FP8 activations)."""
    if config.quantized_compute is not None:
        return config.quantized_compute
    return model_config.quantization is not None and config.dtype == "bfloat16"


def build_runner(
    model_dir: str | os.PathLike,
    config: EngineConfig,
    tp: TensorParallel,
    channel: Channel | None = None,
) -> ModelRunner:
    """This rank's runner; channel: rank 0's line to the other ranks (None on the others)."""
    device = device_of(config, tp.rank)
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    family = models.family(model_dir)
    cfg = family.ModelConfig.from_dir(model_dir)
    spec = config.speculative
    if spec is not None:  # the draft head's KV state in the pools, gamma resolved
        cfg, spec = draft_config(cfg, spec, model_dir)
    dtype = DTYPES[config.dtype]
    model: Model
    if config.simulate is not None:  # no weights: steps take the profile's time
        token = Tokenizer.from_pretrained(model_dir).encode("x")[-1]
        model = SimulatedModel(CostModel.from_profile(config.simulate), cfg.vocab_size, token)
    else:
        model = family.build_model(cfg, dtype, device, keeps_quantized(config, cfg), tp)
        family.load_weights(model, model_dir)
        if spec is not None:
            check_loaded(model, str(model_dir), spec)
    max_context = config.max_model_len or cfg.max_position_embeddings
    kv_cfg = KVCacheConfig(
        memory_bytes=tp.agree(_kv_budget(config, device), device),
        staging_bytes=config.kv_staging_memory_bytes,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_dtype=config.kv_cache_dtype,
        speculative_tokens=spec.num_speculative_tokens if spec else 0,
    )
    if config.enable_prefix_caching:
        size = config.prefix_cache_checkpoint_memory_bytes
        each = checkpoint_bytes(
            cfg, kv_cfg.page_size, dtype.itemsize, kv_cfg.fp8, kv_cfg.speculative_tokens
        )
        if size is None:
            rows = default_checkpoint_rows(cfg, kv_cfg, dtype.itemsize)
        else:  # a family without per-position state needs no checkpoint (each == 0)
            rows = size // each if each else 0
        kv_cfg = dataclasses.replace(kv_cfg, checkpoint_rows=rows)
    kv_cfg = _fit_sequences(cfg, kv_cfg, dtype.itemsize, config.max_num_seqs, tp.rank == 0)
    pool = KVPool(cfg, kv_cfg, dtype=dtype, device=device, max_context=max_context)
    host = None
    if config.enable_prefix_caching and config.kv_offloading_size:
        size = int(config.kv_offloading_size * 2**30)
        host = HostTier(size, pool.staging.block_bytes, pool.cell_bytes, pool.cell_rows)
    runner = ModelRunner(model, pool, device, max_context, channel, host)
    # (speculative steps keep the streams the draft head reads: eager)
    graphs = not config.enforce_eager and spec is None
    if (
        device.type == "cuda"
        and graphs
        and dtype is torch.bfloat16
        and not tp.ep
        and model.cuda_graphs
    ):
        # (torch's grouped GEMM of other dtypes syncs with the host on CUDA, and so do the
        # expert-parallel all-to-alls' sizes: eager there)
        sizes = [b for b in DEFAULT_GRAPH_BATCH_SIZES if b <= kv_cfg.max_num_seqs]
        runner.capture_decode_graphs(sizes)
    return runner


def _fit_sequences(
    cfg: KVModel, kv_cfg: KVCacheConfig, esize: int, asked: int | None, say: bool
) -> KVCacheConfig:
    """`kv_cfg` with max_num_seqs lowered to what the budget holds (engine.kv.layout.
    fit_max_num_seqs: the default to a share of it, an `asked` number only where it leaves
    nothing for context), said in the log (`say`: on one rank), as vLLM reports the
    concurrency its blocks allow."""
    seqs = fit_max_num_seqs(cfg, kv_cfg, esize, share=SEQUENCE_SHARE if asked is None else 1)
    if seqs < kv_cfg.max_num_seqs and say:  # (a warning only where it was asked for)
        log.log(
            logging.INFO if asked is None else logging.WARNING,
            "max_num_seqs lowered from %d to %d: the KV cache budget of %.1f MiB holds the fixed "
            "state of %d sequences (%.2f MiB each: window ring, open entry pages, compressor "
            "rings) beside their context; raise --kv-cache-memory-bytes for more",
            kv_cfg.max_num_seqs,
            seqs,
            kv_cfg.memory_bytes / 2**20,
            seqs,
            sequence_bytes(cfg, kv_cfg, esize) / 2**20,
        )
    return dataclasses.replace(kv_cfg, max_num_seqs=seqs)


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    # Leave (1 - utilization) of the card, plus headroom for activations and graphs.
    return max(0, int(free - total * (1 - config.gpu_memory_utilization) - (2 << 30)))


def follower_main(model_dir: str, config: EngineConfig, rank: int, world: World) -> None:
    """A follower rank's process (multiprocessing's spawn target): build its shard exactly as
    its leader builds its own (collectives in lockstep), then serve the leader's calls until it
    closes the group."""
    tp, channel = join_follower(rank, world, device_of(config, rank))
    serve(build_runner(model_dir, config, tp), channel)
    dist.destroy_process_group()


@torch.inference_mode()
def serve(runner: ModelRunner, channel: Channel) -> None:
    """Run rank 0's calls, on this rank's shard and pool, until it sends None."""
    while (call := channel.recv()) is not None:
        for write in call.table_writes:  # the pages rank 0's scheduler gave out since
            runner.pool.write_page_table(*write)
        getattr(runner, call.method)(*call.args)
