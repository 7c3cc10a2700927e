"""The prefix cache's second tier (`--kv-offloading-size`, vLLM's name): pinned host memory that
state evicted from the device pools moves to, and comes back from on a hit.

What moves is whole pages and slab rows, as their arena cells (engine.kv.pool): an item's cells
are packed into blocks of the staging block's size, in the order `KVPool.cells` lists them, so
only block ids need keeping. The bookkeeping (which item has which blocks) is the prefix cache's
on rank 0; `save` and `load` run on every rank of a tensor-parallel group, each on its own pools
and its own host blocks.

Overlap with compute: a save gathers the cells on the engine's stream (so it reads the pages
before anything the same step writes into them) and copies them to the host on a stream of its
own; a load copies to the device on that stream, and the engine's stream waits for it only where
the step that resumes from it begins, so the copy runs while the device computes the step
before (async scheduling schedules step N+1 while step N runs). Both copy in runs of consecutive
blocks. On the CPU every copy is immediate.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from dsaserve.engine.async_copy import to_device
from dsaserve.engine.kv.staging import BlockAllocator


class HostTier:
    def __init__(
        self, size_bytes: int, block_bytes: int, cell_bytes: int, rows: torch.Tensor
    ) -> None:
        """rows: the pool's arena as cells ([cells, words], KVPool.cell_rows)."""
        self.block_bytes, self.cells_per_block = block_bytes, block_bytes // cell_bytes
        num_blocks = size_bytes // block_bytes
        self._rows = rows
        cuda = rows.is_cuda
        words = self.cells_per_block * rows.shape[1]
        self.blocks = torch.zeros(num_blocks, words, dtype=rows.dtype, pin_memory=cuda)
        self._cells = self.blocks.view(num_blocks * self.cells_per_block, -1)  # [cells, words]
        self.allocator = BlockAllocator(num_blocks)
        self._stream = torch.cuda.Stream(rows.device) if cuda else None
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # saves' buffers

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_cells: int) -> int:
        return -(-num_cells // self.cells_per_block)

    def save(self, cells: np.ndarray, blocks: list[int]) -> None:
        """Every rank: the arena cells [n] into host blocks, in order."""
        src = self._rows.index_select(0, to_device(cells, torch.int64, self._rows.device))
        if self._stream is None:
            for at, first, count in self._runs(blocks, len(cells)):
                self._cells[first : first + count] = src[at : at + count]
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._rows.device))
        with torch.cuda.stream(self._stream):
            for at, first, count in self._runs(blocks, len(cells)):
                self._cells[first : first + count].copy_(src[at : at + count], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._in_flight = [(e, b) for e, b in self._in_flight if not e.query()] + [(done, src)]

    def load(self, blocks: list[int], cells: np.ndarray) -> None:
        """Every rank: host blocks back into the arena cells [n] (the engine's stream waits for
        the copy where this is called, not the host)."""
        dst = to_device(cells, torch.int64, self._rows.device)
        if self._stream is None:
            src = torch.cat([self._cells[f : f + c] for _, f, c in self._runs(blocks, len(cells))])
            self._rows.index_copy_(0, dst, src)
            return
        compute = torch.cuda.current_stream(self._rows.device)
        with torch.cuda.stream(self._stream):
            src = torch.empty(
                len(cells), self._rows.shape[1], dtype=self._rows.dtype, device=self._rows.device
            )
            for at, first, count in self._runs(blocks, len(cells)):
                src[at : at + count].copy_(self._cells[first : first + count], non_blocking=True)
        compute.wait_stream(self._stream)
        src.record_stream(compute)  # (made on the copy stream, read on the engine's)
        self._rows.index_copy_(0, dst, src)

    def _runs(self, blocks: list[int], num_cells: int) -> Iterator[tuple[int, int, int]]:
        """(first cell of the item, first host cell, cells) of each run of consecutive blocks."""
        per, at, i = self.cells_per_block, 0, 0
        while i < len(blocks) and at < num_cells:
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            count = min((j - i) * per, num_cells - at)
            yield at, blocks[i] * per, count
            at, i = at + count, j
