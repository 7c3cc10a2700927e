"""`dsaserve decode`: a decode worker (gRPC) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from dsaserve.services.decode.service import DecodeService
from dsaserve.services.worker.data_parallel import run_ranks
from dsaserve.services.worker.process import Worker
from dsaserve.services.worker.settings import DecodeSettings

Settings = DecodeSettings


def run(settings: DecodeSettings) -> None:
    run_ranks(settings, serve)


def serve(settings: DecodeSettings) -> None:
    """One decode worker (one data-parallel rank of a worker)."""
    worker = Worker(settings, "decode")
    asyncio.run(worker.serve(DecodeService(worker)))
