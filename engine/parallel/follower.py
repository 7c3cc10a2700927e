"""A follower rank of a tensor-parallel engine (ranks 1..N-1): builds its shard exactly as rank 0
builds its own (engine.rank.build_runner, collectives in lockstep), then runs every call rank 0
sends, on its own shard and pool, until rank 0 closes the group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel.channel import Channel
from engine.parallel.launch import join_follower
from engine.rank import build_runner, device_of
from engine.runner import ModelRunner


def main(model_dir: str, config: EngineConfig, rank: int, size: int, port: int) -> None:
    """The follower process (multiprocessing's spawn target)."""
    tp, channel = join_follower(rank, size, port, device_of(config, rank))
    serve(build_runner(model_dir, config, tp), channel)
    dist.destroy_process_group()


@torch.inference_mode()
def serve(runner: ModelRunner, channel: Channel) -> None:
    """Run rank 0's calls until it sends None."""
    while (call := channel.recv()) is not None:
        for write in call.table_writes:  # the pages rank 0's scheduler gave out since
            runner.pool.write_page_table(*write)
        getattr(runner, call.method)(*call.args)
