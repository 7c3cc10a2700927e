"""The staging buffer: a held request's KV state packed into a few runs of large blocks, so that
a decode worker pulls it with a few large READs.

Why this and not the other ways to cut descriptors (issue "GPU groups", point 4). A 32K-token
V4-Flash state is ~3900 page-sized pieces (a page of one layer's pool each, scattered by the
allocators); UCX pays per descriptor, so one READ of them moves 8.5 GB/s on NVLink where a plain
GPU-to-GPU copy moves 378 GB/s.
- Fusing a kind's layers into one page unit ([slots, layers, D] keeps one row stride per layer,
  so the kernels could stay) still leaves one descriptor per scattered page: 190 descriptors
  reached 68 GB/s median, and every gather of a decode step would stride over all layers' rows.
- Contiguous page runs cannot be promised: pages on both sides are scattered after churn.
- Prepared descriptor lists cut NIXL's setup per READ, not UCX's cost per descriptor.
- Staging leaves the pools and the decode step as they are. When a request's prefill is done,
  the prefill worker gathers its pages into staging blocks (one indexed copy per run of blocks,
  before the first token is returned; nothing waits on decode) and frees the pages at once: the
  held KV lives in staging instead of pages. The decode worker READs the blocks a chunk at a
  time (one descriptor per run of blocks, picked from lists prepared once per peer) into a ring
  of its own blocks, and scatters each landed chunk into its pages while the next chunks are in
  flight: the pull runs at the READ's bandwidth, plus the scatter of its last chunk.
When too few staging blocks are free, the request stays in its pages and the reader READs those
(slower): prefill never waits for a decode worker to make room.

The gather and the scatter move whole cells (16 KiB rows on V4-Flash; see engine.kv.pool): a
plain torch index_select / index_copy_ each, no kernel of our own. bench/transfer.py times the
gather (at the prefill worker) and the pull with its scatters. With --kv-cache-dtype fp8 the
cells are 256-byte rows (584- and 132-byte rows share only 4 bytes a slot): ~36x the indices for
~0.56x the bytes, not yet timed on a GPU.

Memory: staged requests get 1/16 of the KV budget left after fixed costs (or
KVCacheConfig.staging_bytes); the ring (RING_SLOTS chunks, 100 MB on V4-Flash) is outside the
budget. A decode worker only uses the ring: its share for staged requests sits idle.

Stream: `KVPool.stream`'s order, the slab row, the window ring pages, then the entry pages from
the newest to the oldest (each page's regions together), so a reader whose prefix cache holds a
prefix's full pages pulls the stream's first blocks only; block i of a request holds bytes
[i * block_bytes, (i + 1) * block_bytes) of it. Both workers derive the stream from
the layout they share (its hash covers regions, their order and the block size), so only block
ids travel. The ring and its chunk size are the puller's own.

Threads: `stage` runs on the engine thread, on its stream, and returns once the blocks hold the
bytes. An `Unpacker` runs on the puller's thread, on a stream of its own (a scatter must not wait
behind a decode step, nor the step behind it), and writes only pages reserved for the request
being pulled, which no step reads before the request joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dsaserve.engine.kv import memory
from dsaserve.engine.kv.allocator import OutOfPages

RING_SLOTS = 4  # chunks a pull keeps in flight while it scatters a landed one
# Blocks per chunk: a chunk of a V4-Flash state is 25 MB, a READ of ~70 us over NVLink, longer
# than the host work of posting the next READ and scattering this one.
CHUNK_BLOCKS = 16


class KVStaging:
    """Blocks of `block_bytes` in one tensor NIXL registers: a ring of RING_SLOTS chunks that
    pulls land in, then `outbox` blocks that hold staged requests."""

    def __init__(
        self,
        outbox: int,
        block_bytes: int,
        cell_bytes: int,
        word: torch.dtype,
        device: torch.device,
    ) -> None:
        num_blocks = RING_SLOTS * CHUNK_BLOCKS + outbox
        words = block_bytes // torch.empty((), dtype=word).element_size()
        self.block_bytes, self.cells_per_block = block_bytes, block_bytes // cell_bytes
        # [blocks, words]
        self.blocks = memory.zeros(num_blocks * words, word, device).view(num_blocks, words)
        self._cells = self.blocks.view(num_blocks * self.cells_per_block, -1)  # [cells, words]
        self.allocator = BlockAllocator(num_blocks)
        self.ring = [self.allocator.allocate(CHUNK_BLOCKS) for _ in range(RING_SLOTS)]
        self._stream = torch.cuda.Stream(device) if self.blocks.is_cuda else None

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_total(self) -> int:
        """Blocks requests can hold (the ring's are never free)."""
        return self.allocator.num_pages - RING_SLOTS * CHUNK_BLOCKS

    def stage(self, rows: torch.Tensor, cells: np.ndarray) -> list[int] | None:
        """Copy rows[cells] (a request's stream, cells [n] int64) into free blocks; returns them
        in stream order, or None if too few are free. Runs on the current stream and waits for
        it, so the blocks hold the bytes when it returns."""
        n = -(-cells.size // self.cells_per_block)
        if n > self.allocator.num_free:
            return None
        blocks = self.allocator.allocate(n)
        try:
            src, per = torch.from_numpy(cells).to(rows.device), self.cells_per_block
            for at, first, count in _runs(blocks):
                part = src[at * per : (at + count) * per]
                torch.index_select(rows, 0, part, out=self._cells[first * per :][: part.numel()])
            if rows.is_cuda:
                torch.cuda.current_stream(rows.device).synchronize()
        except BaseException:
            self.allocator.free(blocks)
            raise
        return blocks

    def free(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)

    def unpacker(
        self, rows: torch.Tensor, nbytes: int, cells: Callable[[], np.ndarray]
    ) -> Unpacker:
        return Unpacker(rows, self._cells, nbytes, cells, self, self._stream)


class BlockAllocator:
    """Staging blocks, handed out as few runs of consecutive ids as the free ones allow (each run
    is a descriptor of a pull): the smallest free run that fits, else the longest runs first.
    O(blocks) numpy work per call, for a few thousand blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_pages = self.num_free = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)

    def allocate(self, n: int) -> list[int]:
        """n free block ids, ascending; OutOfPages if fewer are free."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} blocks, {self.num_free} of {self.num_pages} free")
        if n == 0:
            return []
        edges = np.diff(self._free.astype(np.int8), prepend=0, append=0)
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts  # of each free run
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]
            picked = [(starts[best], n)]
        else:
            picked, left = [], n
            for run in np.argsort(-lengths, kind="stable"):
                if left == 0:
                    break
                picked.append((starts[run], min(left, lengths[run])))
                left -= picked[-1][1]
        ids = np.sort(np.concatenate([np.arange(s, s + k) for s, k in picked]))
        self._free[ids] = False
        self.num_free -= n
        return ids.tolist()

    def free(self, ids: list[int]) -> None:
        if self._free[ids].any():
            raise AssertionError(f"double free of staging blocks in {ids}")
        self._free[ids] = True
        self.num_free += len(ids)


class Unpacker:
    """Scatters a pulled stream of `nbytes`, chunk by chunk, into rows[cells()]: a pull's
    `on_chunk`. The cells are worked out at the first chunk, while the next ones are in
    flight, not before the pull's first READ."""

    def __init__(
        self,
        rows: torch.Tensor,
        staged: torch.Tensor,
        nbytes: int,
        cells: Callable[[], np.ndarray],
        staging: KVStaging,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._rows, self._staged, self._stream = rows, staged, stream
        self.nbytes, self._cells = nbytes, cells
        self._dst: torch.Tensor | None = None  # the cells, on the device once the first chunk lands
        self._chunk = CHUNK_BLOCKS * staging.cells_per_block  # cells per chunk
        self._slots = [slot[0] * staging.cells_per_block for slot in staging.ring]  # first cells

    def __call__(self, chunk: int, slot: int) -> None:
        """Chunk `chunk` of the stream has landed in ring slot `slot`: scatter it; returns once
        the slot may be overwritten."""
        with self._on_stream():
            if self._dst is None:
                self._dst = torch.from_numpy(self._cells()).to(self._rows.device)  # [n] int64
            dst = self._dst[chunk * self._chunk : (chunk + 1) * self._chunk]
            self._rows.index_copy_(0, dst, self._staged[self._slots[slot] :][: dst.numel()])
        if self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield


def _runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ids, in order."""
    at = 0
    while at < len(ids):
        end = at + 1
        while end < len(ids) and ids[end] == ids[end - 1] + 1:
            end += 1
        yield at, ids[at], end - at
        at = end
