"""EngineConfig: how one engine runs a model (device, precision, KV memory, batching limits).

Torch-free, so the CLI can describe it without loading torch. Each field carries its help text
and, where vLLM has a name for the setting, that name as its flag (`--max-model-len`,
`--block-size`, `--enforce-eager`, ...): `services.settings` turns the fields into command-line
flags and `DSASERVE_*` variables, so the settings are written once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.speculative.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_NUM_SEQS = 256
KV_CACHE_DTYPES = ("auto", "fp8")


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field with its command-line description.

    `cli` may hold `flag` (the long option, when it differs from the field name), `aliases`
    (old spellings, accepted but hidden from --help), `short` (e.g. "-tp"), `choices`, and
    `cli=False` for fields that are not flags.
    """
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """Engine (device, precision, KV memory, batching)"""

    device: str = setting("cpu", "torch device of the engine (cpu, cuda, cuda:1, ...)")
    dtype: str = setting(
        "float32",
        "activation and KV dtype (float32 on CPU is exact; bfloat16 on GPUs)",
        choices=DTYPES,
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "bytes of KV pool (default: a share of free GPU memory; 512 MiB on CPU)",
        aliases=("--kv-cache-memory",),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache storage: auto (the --dtype) or fp8 (vLLM's fp8_ds_mla pages: DeepSeek-V4's "
        "window rows and compressed entries as 448 e4m3 + 64 bf16 RoPE values with ue8m0 "
        "scales, 584 bytes instead of 1024 in bf16; DeepSeek-V3.2's latent rows as 512 e4m3 "
        "with 4 fp32 scales + 64 bf16 RoPE values, 656 bytes instead of 1152; indexer keys as "
        "e4m3 with one fp32 scale; more tokens in the same --kv-cache-memory-bytes: "
        "engine.kv.layout.bytes_per_token computes how many, bench/README.md 'FP8 KV cache' "
        "records it per model)",
        choices=KV_CACHE_DTYPES,
    )
    kv_staging_memory_bytes: int | None = setting(
        None,
        "bytes of the KV budget that hold prefilled requests packed for a fast pull "
        "(default: 1/16 of what is left after fixed costs; a decode worker's default is 0)",
    )
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory the engine may use")
    page_size: int = setting(
        64,
        "entries (window rows or compressed entries) per KV page",
        flag="--block-size",
        aliases=("--page-size",),
    )
    max_num_seqs: int | None = setting(
        None,
        f"requests that may hold KV at once (default: {DEFAULT_MAX_NUM_SEQS}, or as many as half "
        "of the KV budget holds the fixed state of, where that is fewer: window ring, open "
        "entry pages, compressor rings; a number asked for is lowered only where the budget "
        "cannot hold it beside any context; the log says so)",
    )
    max_num_batched_tokens: int = setting(8192, "rows one forward step may compute")
    max_model_len: int | None = setting(
        None,
        "longest prompt + output (default: the model's max_position_embeddings)",
        aliases=("--context-length",),
    )
    quantized_compute: bool | None = setting(
        None,
        "FP8/FP4 checkpoints: keep the weights quantized and compute as the release does (FP8 "
        "activations, block-scaled GEMMs, FP4 experts), or dequantize them at load and run "
        "dense (--no-quantized-compute). Default: quantized for bfloat16, dequantized for "
        "float32",
    )
    async_scheduling: bool = setting(
        True,
        "schedule and launch each step while the device still runs the one before (the host's "
        "work hides behind the device's; a request that stops computes one row more); "
        "--no-async-scheduling waits for every step's tokens before scheduling the next",
    )
    enable_prefix_caching: bool = setting(
        True,
        "resume each prompt from the KV state of an earlier one with the same leading tokens "
        "(content-hashed blocks; full compressed-entry pages shared, window rows and compressor "
        "state checkpointed at the end of every prompt and every "
        "--prefix-cache-checkpoint-interval tokens along it); --no-enable-prefix-caching "
        "computes every prompt from its first token",
    )
    prefix_cache_checkpoint_interval: int = setting(
        512,
        "tokens between the prefix cache's checkpoints along a prompt: a prompt that shares L "
        "tokens with a cached one resumes at least L minus this far in (each checkpoint costs "
        "a window of rows and the compressor rings of every layer)",
    )
    prefix_cache_checkpoint_memory_bytes: int | None = setting(
        None,
        "bytes of the KV budget that hold the prefix cache's checkpoints (default: 1/8 of what "
        "is left after fixed costs; a decode worker's default is 0); the shared entry pages "
        "come from the pages themselves",
    )
    kv_offloading_size: float | None = setting(
        None,
        "GiB of pinned host memory per rank for the prefix cache's second tier: what it evicts "
        "from the device moves there and comes back on a hit, copied while the device computes "
        "(default: none, evicted state is dropped)",
    )
    enforce_eager: bool = setting(
        False, "never capture CUDA graphs for decode steps", aliases=("--no-cuda-graphs",)
    )
    cpu_threads: int = setting(1, "intra-op threads on CPU (small models lose with more)")
    tensor_parallel_size: int = setting(
        1,
        "processes (GPUs) one engine spans: query heads and vocabulary split across them, routed "
        "experts in contiguous ranges, the KV replicated; rank r takes the r-th visible GPU "
        "(--device cuda), or runs on the CPU over gloo",
        short="-tp",
    )
    data_parallel_size: int = setting(
        1,
        "attention (data-parallel) ranks one worker spans, each an engine of its own (scheduler, "
        "KV pools, requests) of --tensor-parallel-size processes; with --enable-expert-parallel "
        "they share the routed experts and step in lockstep. A worker's ranks register as "
        "workers of their own, each with its own gRPC port (--port + rank)",
        short="-dp",
    )
    data_parallel_rank: int = setting(
        0, "this engine's data-parallel rank (set by the launcher)", cli=False
    )
    enable_expert_parallel: bool = setting(
        False,
        "split the routed experts over every rank of every data-parallel rank's group "
        "(data-parallel size x tensor-parallel size), tokens dispatched to their experts' "
        "owners and combined back by all-to-alls, instead of over one tensor-parallel group",
    )
    nnodes: int = setting(
        1,
        "hosts one data-parallel group spans (torchrun's name); each runs an equal share of the "
        "data-parallel ranks, whole tensor-parallel groups",
    )
    node_rank: int = setting(0, "this host's place among --nnodes (0 hosts the rendezvous)")
    master_addr: str = setting(
        "127.0.0.1", "address of node 0, where the group's ranks meet (torchrun's name)"
    )
    master_port: int = setting(
        0,
        "TCP port of the group's rendezvous on --master-addr (0: a free one; required with "
        "--nnodes above 1)",
    )

    simulate: str | None = setting(
        None,
        "run no model: each step sleeps for the time a cost model fitted to this measured "
        "profile (a bench record such as bench/results/h200-engine-256.json) gives it, and "
        "every request runs to max_tokens; the rest of the engine is real (page accounting, "
        "prefix cache, leases, transfers): the control plane at cluster size on a CPU",
    )

    speculative_config: str | None = setting(
        None,
        'speculative decoding, vLLM\'s JSON: \'{"method": "mtp", "num_speculative_tokens": '
        "K}' drafts K = 1..4 tokens per step with the checkpoint's multi-token-prediction "
        "layer (applied K times) and verifies them in one target step (greedy requests keep "
        "exactly their tokens, sampled ones follow the target distribution by rejection "
        "sampling); '\"adaptive\": true' picks each step's drafts from the measured acceptance "
        "and step cost. Prefill and decode workers must agree on it (the KV layout names it)",
    )

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)  # (ValueError naming the field)
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (
                self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
            ),
            (
                0 < self.gpu_memory_utilization <= 1,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (self.page_size >= 1, f"the block size must be >= 1, got {self.page_size}"),
            (
                self.max_num_seqs is None or self.max_num_seqs >= 1,
                f"max_num_seqs must be >= 1, got {self.max_num_seqs}",
            ),
            (
                self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 2,
                f"max_model_len must be >= 2, got {self.max_model_len}",
            ),
            (
                self.kv_staging_memory_bytes is None or self.kv_staging_memory_bytes >= 0,
                f"kv_staging_memory_bytes must be >= 0, got {self.kv_staging_memory_bytes}",
            ),
            (self.cpu_threads >= 1, f"cpu_threads must be >= 1, got {self.cpu_threads}"),
            (
                (self.prefix_cache_checkpoint_memory_bytes or 0) >= 0,
                "prefix_cache_checkpoint_memory_bytes must be >= 0, got "
                f"{self.prefix_cache_checkpoint_memory_bytes}",
            ),
            (
                (self.kv_offloading_size or 0) >= 0,
                f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}",
            ),
            (
                self.prefix_cache_checkpoint_interval >= 1,
                "prefix_cache_checkpoint_interval must be >= 1, got "
                f"{self.prefix_cache_checkpoint_interval}",
            ),
            (
                self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
            ),
            (
                self.tensor_parallel_size == 1 or self.device in ("cpu", "cuda"),
                f"with tensor parallelism the device is 'cuda' (rank r takes the r-th visible "
                f"GPU; choose them with CUDA_VISIBLE_DEVICES) or 'cpu', got {self.device!r}",
            ),
            (
                self.data_parallel_size >= 1,
                f"data_parallel_size must be >= 1, got {self.data_parallel_size}",
            ),
            (
                0 <= self.data_parallel_rank < self.data_parallel_size,
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), got "
                f"{self.data_parallel_rank}",
            ),
            (
                self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}",
            ),
            (
                self.data_parallel_size % self.nnodes == 0,
                f"the {self.data_parallel_size} data-parallel ranks do not split over "
                f"{self.nnodes} nodes (each holds whole tensor-parallel groups)",
            ),
            (
                self.simulate is None or self.tensor_parallel_size * self.data_parallel_size == 1,
                "a simulated engine (--simulate) runs as one rank",
            ),
            (
                self.speculative_config is None
                or (self.data_parallel_size == 1 and self.simulate is None),
                "--speculative-config does not run with --data-parallel-size > 1 (an idle "
                "rank's padded step does not pad the draft passes' all-to-alls) or --simulate yet",
            ),
            (
                self.nnodes == 1 or self.master_port > 0,
                "a group over several nodes needs --master-port (and --master-addr: node 0)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def data_parallel_per_node(self) -> int:
        return self.data_parallel_size // self.nnodes

    def node_ranks(self) -> range:
        """The data-parallel ranks this node runs."""
        per = self.data_parallel_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def local_index(self, global_rank: int) -> int:
        """A global rank's place among its node's ranks: its GPU's index there."""
        return global_rank - self.node_ranks().start * self.tensor_parallel_size
