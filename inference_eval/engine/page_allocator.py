"""Fixed-size KV pages handed out to requests; one allocator serves target and draft caches.

Target and draft caches are indexed by the same page ids, so one block table per request
addresses both (a draft head's cache simply has fewer layers per page).
"""
from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # Pop from the end: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise OutOfPagesError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        out = self._free[len(self._free) - num_pages:]
        del self._free[len(self._free) - num_pages:]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
