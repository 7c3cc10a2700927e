"""`dsaserve prefill`: a prefill worker (gRPC) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from dsaserve.services.prefill.service import PrefillService
from dsaserve.services.worker.data_parallel import run_ranks
from dsaserve.services.worker.process import Worker
from dsaserve.services.worker.settings import PrefillSettings

Settings = PrefillSettings


def run(settings: PrefillSettings) -> None:
    run_ranks(settings, serve)


def serve(settings: PrefillSettings) -> None:
    """One prefill worker (one data-parallel rank of a worker)."""
    worker = Worker(settings, "prefill")
    asyncio.run(worker.serve(PrefillService(worker)))
