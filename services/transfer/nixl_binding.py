"""The installed NIXL binding, whichever package provides it.

The backend wheels install as `nixl_cu13` / `nixl_cu12`; the plain `nixl` name exists only with the
meta package, which picks the variant matching torch's CUDA, so it goes first. The GPU machine has
only nixl-cu13, the CPU test machine only nixl-cu12.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
nixl_agent = api.nixl_agent
nixl_agent_config = api.nixl_agent_config
