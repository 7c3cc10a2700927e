"""Tensor and expert parallelism inside one engine: one process per GPU under torch.distributed.

    group.py     TensorParallel (rank, size, the collectives the split layers call), shard marks
    channel.py   rank 0 -> the other ranks: each runner call, with the page-table writes
    launch.py    rank 0 spawns the followers; everyone joins the group; close

These are primitives: what a follower process builds and runs is engine.rank's
(`follower_main`), which sits above them with the runner.

Rank 0 is the process that builds the `LLMEngine`: it owns the scheduler, the sampler, the
tokenizer and (in a worker) gRPC and the NIXL agent. Each step it sends the step's RowSpans to
the other ranks; every rank runs the forward on its shard (CUDA graphs on every rank, captured in
the same order) and the collectives meet inside the model. DeepSeek-V4's single KV head is
whole on every rank, so every rank's pools hold the same KV; rank 0 alone allocates pages and
its page-table writes ride along with the next call. How the model splits:
engine.models.deepseek_v4 (attention, moe, model) and engine.layers.parallel.
"""
