"""A worker of data-parallel size D is D workers: each data-parallel rank is an engine of its own
(engine.llm_engine) and serves as a worker of its own, with its gRPC port, probes, NIXL agent
and registry record (`<worker id>-dp<rank>`). The router sees every rank: its load, its prefix
cache (cache-aware routing keeps a conversation on the rank that holds its KV), and a decode
rank pulls the KV it decodes itself, so no KV ever moves between the ranks of one worker.

This process serves its node's first rank and starts the node's other ranks as processes of
their own (each dies with it); ports count up from --port and --metrics-port by the rank's
place on the node (0 stays 0: an ephemeral gRPC port, no probes). The price: D registry records
and gRPC endpoints per worker, and a dead rank takes its whole group down (the ranks share the
experts' all-to-alls). Across hosts (--nnodes, --node-rank, --master-addr, --master-port,
torchrun's names) each node runs D / nnodes whole engines (tensor-parallel groups stay inside a
node), node k serving ranks k * D / nnodes on, all meeting at node 0's store
(deploy/k8s/overlays/lws runs a decode worker so).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable
from typing import TypeVar

from dsaserve.engine.config import EngineConfig
from dsaserve.engine.parallel.launch import die_with_parent
from dsaserve.engine.ports import free_port
from dsaserve.services.worker.settings import WorkerSettings

S = TypeVar("S", bound=WorkerSettings)


def run_ranks(settings: S, serve: Callable[[S], None]) -> None:
    """Serve this node's data-parallel ranks: serve(settings of a rank) for each, the first in
    this process. `serve` must be a module-level function (it is started by name)."""
    engine = settings.engine
    if engine.data_parallel_size == 1:
        serve(settings)
        return
    if engine.master_port == 0:  # one node: pick the rendezvous before any rank starts
        engine = dataclasses.replace(engine, master_port=free_port(engine.master_addr))
    first, *others = engine.node_ranks()
    spawn = multiprocessing.get_context("spawn")
    processes = [
        spawn.Process(
            target=_serve_rank,
            args=(serve, rank_settings(settings, engine, rank)),
            name=f"dsaserve-dp-rank{rank}",
            daemon=False,  # (a rank starts processes of its own: its tensor-parallel ranks)
        )
        for rank in others
    ]
    for p in processes:
        p.start()
    try:
        serve(rank_settings(settings, engine, first))
    finally:
        for p in processes:
            p.join()


def rank_settings(settings: S, engine: EngineConfig, rank: int) -> S:
    """The settings of data-parallel rank `rank` of a worker (`engine`: with its rendezvous)."""
    offset = rank - engine.node_ranks().start
    return dataclasses.replace(
        settings,
        engine=dataclasses.replace(engine, data_parallel_rank=rank),
        port=settings.port + offset if settings.port else 0,
        metrics_port=settings.metrics_port + offset if settings.metrics_port else 0,
        worker_id=f"{settings.worker_id}-dp{rank}" if settings.worker_id else None,
    )


def _serve_rank(serve: Callable[[S], None], settings: S) -> None:
    die_with_parent()
    serve(settings)
