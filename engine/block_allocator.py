"""Fixed-size unit allocator with refcounts (pages of a KV pool group, or slab rows)."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Not enough free units; callers queue the work (never a crash)."""


class BlockAllocator:
    """O(1) alloc/free over ids 0..num_blocks-1.

    Refcounts exist so that prefix sharing can later map one page into several requests;
    a unit returns to the free list when its count drops to zero.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} units, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"unit {i} is not allocated"
            self._refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"double free of unit {i}"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)
