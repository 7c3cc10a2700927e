"""Page ids -> NIXL descriptor rows, with runs of consecutive pages merged; or one row per
page, for descriptor lists prepared once.

A READ moves, for every region of a group, page remote[i] of the peer into page local[i] here.
Where both sides continue a run (remote[i+1] = remote[i] + 1 and local[i+1] = local[i] + 1) the
run becomes one descriptor: fewer, larger descriptors are what UCX moves fast.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import TransferError
from .layout import RegionInfo


def page_ids(ids: Sequence[int], pages: int, what: str) -> np.ndarray:
    """Validate page ids against a region's page count: [n] int64, or TransferError.

    Checked here, before anything is posted, so a bad id can never become a wild read or write.
    """
    a = np.asarray(ids)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TransferError(f"{what}: page ids must be a flat sequence of integers")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= pages):
        bad = a[(a < 0) | (a >= pages)][0]
        raise TransferError(f"{what}: page id {bad} is out of range [0, {pages})")
    return a


def runs(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired page ids into runs consecutive on both sides.

    remote, local: [n] int64. Returns (remote_start, local_start, length), each [runs] int64.
    Pairs are first put in remote order (a READ's descriptors may go in any order): a LIFO
    allocator hands freed pages back reversed, and sorting lets such runs merge too.
    """
    n = remote.size
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    order = np.argsort(remote, kind="stable")
    remote, local = remote[order], local[order]
    breaks = np.flatnonzero((np.diff(remote) != 1) | (np.diff(local) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return remote[starts], local[starts], lengths


def rows(region: RegionInfo, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Descriptor rows (addr, bytes, device) of runs in one region: [runs, 3] uint64."""
    out = np.empty((starts.size, 3), np.uint64)
    out[:, 0] = region.addr + starts.astype(np.uint64) * region.page_bytes
    out[:, 1] = lengths.astype(np.uint64) * region.page_bytes
    out[:, 2] = region.device
    return out


def every_page(region: RegionInfo) -> np.ndarray:
    """Descriptor rows of each page of a region, page i in row i: [pages, 3] uint64."""
    ids = np.arange(region.pages, dtype=np.int64)
    return rows(region, ids, np.ones_like(ids))
