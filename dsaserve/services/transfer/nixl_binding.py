"""The installed NIXL binding, whichever package provides it.

The backend wheels install as `nixl_cu13` / `nixl_cu12`; the plain `nixl` name exists only with the
meta package, which picks the variant matching torch's CUDA, so it goes first. The GPU machine has
only nixl-cu13, the CPU test machine only nixl-cu12.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def _load() -> ModuleType:
    failures = []
    for name in _CANDIDATES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # keep the reason: a broken install reads differently from none
            failures.append(f"{name}: {e}")
    reasons = "\n  ".join(failures)
    raise ImportError(f"NIXL is not importable (pip install nixl-cu12 or nixl-cu13):\n  {reasons}")


api = _load()  # the binding's module, for a record of which one ran


def agent(name: str, progress_wait_us: int) -> Any:
    """A NIXL agent without backends whose progress thread waits up to `progress_wait_us` for
    UCX events between rounds, instead of spinning.

    The UCX backend's shared progress thread arms its workers and polls their event fds with the
    agent config's `pthrDelay` as timeout. The Python API sets that to 0, so an idle agent polls
    without waiting: a core per worker process (measured: 99% of one on an idle machine). Events
    still wake the thread at once; the wait only bounds a round nobody signalled. The API offers
    no way to set it, so the config class is swapped, for this one construction, for a subclass
    whose `pthrDelay` takes our value instead of the 0."""
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class Config(base):  # type: ignore[misc, valid-type]
        pthrDelay = property(
            base.pthrDelay.__get__, lambda self, _: base.pthrDelay.__set__(self, progress_wait_us)
        )

    bindings.nixlAgentConfig = Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    finally:
        bindings.nixlAgentConfig = base
