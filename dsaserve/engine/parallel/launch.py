"""Start and stop a group of ranks: one engine's tensor-parallel group, inside (with data
parallelism) a world of several such engines.

The process that builds an `LLMEngine` with tensor_parallel_size N is its group's leader: it
spawns ranks 1..N-1 of its group (one process each, running engine.rank.follower_main; bench.tp
runs its own), and all join one torch.distributed world through a TCP store (127.0.0.1, or
--master-addr/--master-port across hosts): NCCL for the model's collectives on GPUs (rank r on
the r-th visible GPU of its host), gloo on the CPU, plus a gloo group per engine that carries
its leader's calls (engine.parallel.channel). With data parallelism (`World`) D engines, each
its own leader, share the world: the model's tensor-parallel collectives stay inside each
engine's group, expert parallelism's all-to-alls span the world, and the leaders keep their
steps in lockstep (engine.parallel.lockstep). Followers die with the thread that started them
(Linux PR_SET_PDEATHSIG) and end when their leader closes the group.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import multiprocessing
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsaserve.engine.parallel.channel import Channel
from dsaserve.engine.parallel.expert_parallel import ExpertParallel
from dsaserve.engine.parallel.group import TensorParallel

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


@dataclass(frozen=True)
class World:
    """Every rank of an engine's data-parallel group and where this engine sits in it: global
    rank g = data-parallel rank * tensor-parallel size + tensor-parallel rank; the TCP store
    that joins them runs in global rank 0's process."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    expert_parallel: bool = False
    master_addr: str = HOST
    master_port: int = 0  # 0: global rank 0's store picks one (a lone tensor-parallel group)

    @property
    def size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def leader(self) -> int:
        """The global rank of this engine's tensor-parallel rank 0."""
        return self.data_parallel_rank * self.tensor_parallel_size


def join_follower(rank: int, world: World, device: torch.device) -> tuple[TensorParallel, Channel]:
    """A follower's start: die with its leader, leave Ctrl-C to it (a terminal sends SIGINT to
    the whole process group; the leader stops the others), join as global `rank`."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return join(rank, world, connect(world), device)[:2]


def connect(world: World) -> dist.TCPStore:
    """A client of global rank 0's store (it retries until the store is up)."""
    return dist.TCPStore(
        world.master_addr, world.master_port, world.size, is_master=False, timeout=JOIN_TIMEOUT
    )


def join(
    rank: int, world: World, store: dist.Store, device: torch.device
) -> tuple[TensorParallel, Channel, dist.ProcessGroup | None]:
    """Join the world as global `rank`: this rank's tensor-parallel group (with the expert
    group when expert parallel), the channel of its leader's calls, and (data parallel, on a
    leader) the leaders' group that keeps their steps in lockstep (engine.parallel.lockstep)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world.size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    tp_size, dp_size = world.tensor_parallel_size, world.data_parallel_size
    mine = rank // tp_size
    # Every process creates every group, in the same order (torch.distributed's rule).
    ranks = [list(range(d * tp_size, (d + 1) * tp_size)) for d in range(dp_size)]
    if dp_size == 1:
        model_group = dist.group.WORLD
    else:
        model_group = [dist.new_group(r) for r in ranks][mine]
    control = [dist.new_group(r, backend="gloo", timeout=IDLE_TIMEOUT) for r in ranks][mine]
    lockstep = None
    if dp_size > 1:
        leaders = [r[0] for r in ranks]
        group = dist.new_group(leaders, backend="gloo", timeout=IDLE_TIMEOUT)
        lockstep = group if rank in leaders else None
    ep = ExpertParallel(rank, world.size, dist.group.WORLD) if world.expert_parallel else None
    tp = TensorParallel(rank % tp_size, tp_size, model_group, ep, leader=mine * tp_size)
    return tp, Channel(control), lockstep


class Followers:
    """Ranks 1..N-1 of a leader's tensor-parallel group: their processes, and the channel that
    drives them; and the leader's place in its world."""

    def __init__(
        self,
        world: World,
        device: torch.device,
        target: Callable[..., None],
        *args: object,
    ) -> None:
        """Spawn the other ranks of this leader's tensor-parallel group, each running
        target(*args, global_rank, world) (which joins through global rank 0's store), and join
        as the leader on `device`; global rank 0 hosts the store."""
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process: close() it first"
            )
        if world.leader == 0:
            store = dist.TCPStore(
                world.master_addr,
                world.master_port,
                world.size,
                is_master=True,
                timeout=JOIN_TIMEOUT,
                wait_for_workers=False,
            )
            world = dataclasses.replace(world, master_port=store.port)
        else:
            store = connect(world)
        spawn = multiprocessing.get_context("spawn")
        first, size = world.leader, world.tensor_parallel_size
        self.processes = [
            spawn.Process(
                target=target,
                args=(*args, rank, world),
                name=f"dsaserve-rank{rank}",
                daemon=True,
            )
            for rank in range(first + 1, first + size)
        ]
        for p in self.processes:
            p.start()
        log.info(
            "rank %d of %d: ranks %d..%d in processes %s",
            first,
            world.size,
            first + 1,
            first + size - 1,
            [p.pid for p in self.processes],
        )
        self.tp, self.channel, self.lockstep = join(first, world, store, device)
        self._store = store  # (global rank 0 serves the others' store while it lives)

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
