"""KV transfer between workers over NIXL (UCX): regions, descriptors, pulls of staged KV and
one-READ pulls of pages. Descriptors travel over gRPC (the Prefill service's Describe).

Importing this package imports NIXL (`nixl`, `nixl_cu13` or `nixl_cu12`); keep it out of
processes that move no KV (the router).
"""

from .errors import TransferError
from .kv_transfer import KVTransfer, TransferStats
from .layout import Region

__all__ = [
    "KVTransfer",
    "Region",
    "TransferError",
    "TransferStats",
]
