"""The load of one engine: what a worker reports to the registry and over its Load RPC.

Torch-free: the router reads it from registry records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued for admission
    held: int = 0  # prefill: requests whose KV waits for a decode worker to read it
    free_pages: int = 0  # over all KV pool groups
    total_pages: int = 0
    cached_pages: int = 0  # held only by the prefix cache (free + cached = total when idle)
