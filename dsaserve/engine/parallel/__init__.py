"""Tensor and expert parallelism inside one engine: one process per GPU under torch.distributed.

    group.py            TensorParallel (rank, size, the collectives the split layers call),
                        shard marks
    channel.py          rank 0 -> the other ranks: each runner call, with the page-table writes
    launch.py           rank 0 spawns the followers; everyone joins the group (`World`); close
    expert_parallel.py  the routed experts over a data-parallel world: dispatch and combine
    lockstep.py         data-parallel engines agree on each step

These are primitives: what a follower process builds and runs is engine.rank's
(`follower_main`), which sits above them with the runner.

Rank 0 is the process that builds the `LLMEngine`: it owns the scheduler, the sampler, the
tokenizer and (in a worker) gRPC and the NIXL agent. Each step it sends the step's RowSpans to
the other ranks; every rank runs the forward on its shard (CUDA graphs on every rank, captured in
the same order) and the collectives meet inside the model. DeepSeek-V4's single KV head is
whole on every rank, so every rank's pools hold the same KV; rank 0 alone allocates pages and
its page-table writes ride along with the next call. How the model splits: each family's
attention, moe and model modules, engine.layers.parallel, and the config's
`check_tensor_parallel` (refusing a size that does not split it, before any rank starts). With
fp32 activations a group computes what one rank computes up to the order of a few fp32 sums.

The KV is whole on every rank, but only rank 0's pools are registered with NIXL: a prefill
group's KV is read from its rank 0, a decode group's rank 0 pulls it (one READ, as with one
rank) and `join` broadcasts those pages' bytes to the other ranks over the group
(`ModelRunner.share_pages`). The transfer never knows the group exists, and a pull costs the
prefill side one read whatever the size.
"""
