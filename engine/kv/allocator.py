"""Page allocator with refcounts: the pages of one KV pool group, or the rows of the slab.

A slab row is allocated, transferred and freed exactly like a page (of the group "slab"), so
both use this one allocator.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages; callers queue the work (never a crash)."""


class PageAllocator:
    """O(1) alloc/free over page ids 0..num_pages-1.

    Refcounts exist so that prefix sharing can later map one page into several requests;
    a page returns to the free list when its count drops to zero.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"page {i} is not allocated"
            self._refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"double free of page {i}"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)
