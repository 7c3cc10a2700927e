"""The load of one engine: what a worker reports to the registry and over its Load RPC.

Torch-free: the router reads it from registry records. `step_ms` (the moving average of the
engine's steps, measured by EngineLoop) also stretches the deadlines that wait on a worker's
steps (`step_deadline`: the longer of a floor and N steps), so a slow or loaded worker's healthy
calls are not failed: the router's decode stall timeout (services.router.pd.STALL_STEPS) and its
Aborts (services.router.clients), the prefill lease (services.prefill.service.LEASE_STEPS), and a
puller's Claim, Release and Describe (services.worker.pull, from the peer's `KVHandle.step_ms`).
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
    step_ms: int = 0  # the engine's measured step time (a moving average; 0: none yet)


def step_deadline(floor_s: float, steps: int, step_ms: int) -> float:
    """Seconds to allow for something that waits on about `steps` engine steps of a worker
    whose steps take `step_ms`, and never less than `floor_s`: deadlines that stretch with a
    slow or loaded worker instead of failing healthy calls, and stay put while it is fast."""
    return max(floor_s, steps * step_ms / 1000)
