"""Pages of the KV cache: a free list and per-page reference counts.

A sequence's cache is the list of page ids in `Sequence.pages`; token j lives in page `pages[j // page_size]` at
offset `j % page_size`. Pages are allocated on demand as a sequence grows and returned when it finishes or is
preempted. Reference counts are kept per page so shared pages (prefix caching, forked samples) can build on it.
"""

from __future__ import annotations

import collections

from inference.sequence import Sequence


class OutOfPagesError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self.free_pages: collections.deque[int] = collections.deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(seq.pages) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq.pages` hold at least `num_tokens` tokens."""
        extra = self.pages_needed(num_tokens) - len(seq.pages)
        if extra > self.num_free_pages:
            raise OutOfPagesError(f"need {extra} pages, {self.num_free_pages} free")
        for _ in range(max(extra, 0)):
            page = self.free_pages.popleft()
            self.ref_counts[page] = 1
            seq.pages.append(page)

    def release(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)
        seq.pages = []
