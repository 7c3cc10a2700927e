"""`dsaserve prefill`: a prefill worker (gRPC) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from services.prefill.service import PrefillService
from services.worker.process import Worker
from services.worker.settings import PrefillSettings

Settings = PrefillSettings


def run(settings: PrefillSettings) -> None:
    worker = Worker(settings, "prefill")
    asyncio.run(worker.serve(PrefillService(worker)))
