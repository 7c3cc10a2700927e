"""`dsaserve prefill`: a prefill worker (gRPC) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from services.prefill.service import PrefillService
from services.worker.data_parallel import run_ranks
from services.worker.process import Worker
from services.worker.settings import PrefillSettings

Settings = PrefillSettings


def run(settings: PrefillSettings) -> None:
    run_ranks(settings, serve)


def serve(settings: PrefillSettings) -> None:
    """One prefill worker (one data-parallel rank of a worker)."""
    worker = Worker(settings, "prefill")
    asyncio.run(worker.serve(PrefillService(worker)))
