"""A free TCP port for a listener that binds it later (torch-free).

A port from bind(("", 0)) comes from the kernel's ephemeral range, the range it also hands out
as the source port of every outgoing connection. A process that picks one and binds it seconds
later (a worker loads its model first) can find it taken by a client's connection meanwhile:
under load, `dsaserve up`'s prefill worker lost its gRPC port to one ~20 s after the pick. So
the port is picked at random outside that range, where only another listener could take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # (below: well-known services' registered ports)
_HIGHEST = 65535 - 256  # (data-parallel ranks listen at port + rank)
_rng = random.SystemRandom()  # (not the seeded module state: two seeded runs would collide)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # (Linux's default)
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing is bound to now, outside the ephemeral range."""
    low, high = _ephemeral_range()
    candidates = [*range(_LOWEST, low), *range(high + 1, _HIGHEST + 1)]
    for _ in range(200):
        port = _rng.choice(candidates) if candidates else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on {host} outside the ephemeral range {low}-{high}")
