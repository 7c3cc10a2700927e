"""`dsaserve decode`: a decode worker (gRPC) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from services.decode.service import DecodeService
from services.worker.process import Worker
from services.worker.settings import DecodeSettings

Settings = DecodeSettings


def run(settings: DecodeSettings) -> None:
    worker = Worker(settings, "decode")
    asyncio.run(worker.serve(DecodeService(worker)))
