"""Start and stop a tensor-parallel group.

The process that builds an `LLMEngine` with tensor_parallel_size N is rank 0: it spawns ranks
1..N-1 (one process each, running engine.rank.follower_main; bench.tp runs its own), and
all join one torch.distributed group through a TCP store on 127.0.0.1: NCCL for the model's
collectives on GPUs (rank r on the r-th visible GPU), gloo on the CPU, plus a gloo group that
carries rank 0's calls (engine.parallel.channel). Followers die with the thread that started
them (Linux PR_SET_PDEATHSIG) and end when rank 0 closes the group.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.parallel.channel import Channel
from engine.parallel.group import TensorParallel

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
# Rank 0 waits this long for the followers to start and join (imports, CUDA initialisation).
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
# A collective waits this long for its peers: the first ones follow loading, and one rank may
# read its share of a large checkpoint slower than another.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# Followers wait for rank 0's next call as long as the engine idles: no timeout in practice.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent thread exits (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def join_follower(
    rank: int, size: int, port: int, device: torch.device
) -> tuple[TensorParallel, Channel]:
    """A follower's start: die with rank 0, leave Ctrl-C to it (a terminal sends SIGINT to the
    whole process group; rank 0 stops the others), join the group through the store at `port`."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore(HOST, port, size, is_master=False, timeout=JOIN_TIMEOUT)
    return join(rank, size, store, device)


def join(
    rank: int, size: int, store: dist.Store, device: torch.device
) -> tuple[TensorParallel, Channel]:
    """Join the group as `rank`: the model's group, and the channel of rank 0's calls."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD), Channel(control)


class Followers:
    """Ranks 1..N-1 of rank 0's group: their processes, and the channel that drives them."""

    def __init__(
        self, size: int, device: torch.device, target: Callable[..., None], *args: object
    ) -> None:
        """Spawn ranks 1..size-1, each running target(*args, rank, size, port) (which joins the
        group through the TCP store at `port`), and join the group as rank 0 on `device`."""
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process: close() it first"
            )
        store = dist.TCPStore(
            HOST, 0, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
        )
        spawn = multiprocessing.get_context("spawn")
        self.processes = [
            spawn.Process(
                target=target,
                args=(*args, rank, size, store.port),
                name=f"dsaserve-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.processes:
            p.start()
        log.info(
            "tensor-parallel group of %d: ranks 1..%d in processes %s",
            size,
            size - 1,
            [p.pid for p in self.processes],
        )
        self.tp, self.channel = join(0, size, store, device)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Stop the followers and leave the group; if one died, the group may be stuck in a
        collective: kill the rest and leave the group to the process's exit."""
        graceful = self.alive()
        if graceful:
            self.channel.send(None)
            for p in self.processes:
                p.join(STOP_TIMEOUT_S)
        for p in self.processes:
            if p.is_alive():
                log.warning("tensor-parallel rank %s did not stop; killing it", p.name)
                p.kill()
                p.join()
        if graceful:
            dist.destroy_process_group()
