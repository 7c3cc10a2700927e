"""Page allocator with refcounts: the pages of one KV pool group, or rows of the slab.

A slab row is allocated, transferred and freed exactly like a page (of the group "slab"), so
both use this one allocator. A page's references are a request's (its page table) or the prefix
cache's (engine.prefix_cache.cache): one page may be in several requests' tables and in the cache at
once, and returns to the free list when its last reference goes. The allocator counts the pages
only the cache holds (`num_cached`): those are free for the asking, by an eviction. A worker
exports them as `dsaserve_kv_pages_cached`: free + cached = total on an idle worker.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages; callers queue the work (never a crash)."""


class PageAllocator:
    """O(1) alloc/free over page ids first..first+num_pages-1."""

    def __init__(self, num_pages: int, first: int = 0) -> None:
        self.num_pages, self.first = num_pages, first
        self._free = list(range(first + num_pages - 1, first - 1, -1))  # pop(): low ids first
        self._refs = [0] * num_pages
        self._cache_refs = [0] * num_pages  # of _refs, those the prefix cache holds
        self.num_cached = 0  # pages whose every reference is the cache's

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, cached: bool = False) -> list[int]:
        """n free pages with one reference each (the cache's if `cached`)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i - self.first] = 1
            if cached:
                self._cache_refs[i - self.first] = 1
        self.num_cached += n if cached else 0
        return ids

    def incref(self, ids: list[int], cached: bool = False) -> None:
        for i in ids:
            k = i - self.first
            assert self._refs[k] > 0, f"page {i} is not allocated"
            self._change(k, 1, cached)

    def free(self, ids: list[int], cached: bool = False) -> None:
        """Drop one reference to each page (the cache's if `cached`)."""
        for i in ids:
            k = i - self.first
            assert self._refs[k] > 0, f"double free of page {i}"
            assert not cached or self._cache_refs[k] > 0, f"the cache holds no page {i}"
            self._change(k, -1, cached)
            if self._refs[k] == 0:
                self._free.append(i)

    def refs(self, page: int) -> tuple[int, int]:
        """(references, of which the cache's) of one page."""
        return self._refs[page - self.first], self._cache_refs[page - self.first]

    def _change(self, k: int, by: int, cached: bool) -> None:
        refs, mine = self._refs[k], self._cache_refs[k]
        was = refs > 0 and refs == mine
        self._refs[k], self._cache_refs[k] = refs + by, mine + (by if cached else 0)
        now = self._refs[k] > 0 and self._refs[k] == self._cache_refs[k]
        self.num_cached += now - was
