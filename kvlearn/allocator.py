"""Chapters 1 and 4: the free list of pages, the one allocator of a KV pool's memory.

A pool's memory is cut into pages (a page is a block of chapter 1, or `page_size` slots of chapter
4's pool). The allocator knows which pages are free and nothing else: who holds a page that is not
free (a request, the prefix cache) is its caller's business.

Kept on tensors so that taking or returning many pages is one tensor operation, not a Python loop:
a stack of free page ids (the top at the end: a page freed last is handed out first, likely still
warm in the CPU cache, as in SGLang's `PagedTokenToKVPoolAllocator`; vLLM and nano-vllm use a queue)
and a free flag per page.

Invariant: a page is in the stack exactly when its flag is set; `alloc` and `free` check their
arguments before they change anything, so a refused call leaves the allocator as it was.
"""

from __future__ import annotations

import torch

from kvlearn.allocator_base import AllocatorBase
from kvlearn.errors import KVCapacityError, check_int

_FEW_IDS = 256   # frees of at most this many ids are checked in Python: faster than tensor calls


def check_free_ids(ids: torch.Tensor, limit: int, unit: str = "page") -> None:
    """ValueError unless the 1-D int64 `ids` are distinct and each in [0, limit): what a `free`
    checks before it changes anything (`unit` names them in the message: "page", "slot")."""
    if ids.numel() == 0:
        return
    if ids.numel() <= _FEW_IDS:
        values = ids.tolist()
        low, high, repeated = min(values), max(values), len(set(values)) != len(values)
    else:
        low, high, repeated = int(ids.min()), int(ids.max()), torch.unique(ids).numel() != ids.numel()
    if low < 0 or high >= limit:
        raise ValueError(f"{unit.capitalize()} ids must be in [0, {limit}), got values from {low} to {high}: "
                         f"free only {unit}s that alloc handed out.")
    if repeated:
        raise ValueError(f"Double free: the same {unit} appears more than once in one free() call: "
                         f"list each {unit} once.")


class PageAllocator(AllocatorBase):
    """Hands out and takes back page ids 0 .. num_pages - 1. From `AllocatorBase`
    (kvlearn/allocator_base.py, the base a learner's allocator inherits too): the checked size, the
    device and the repr; this class keeps `num_free` as a counter and `is_free` as flags."""

    def __init__(self, num_pages: int, device=None):
        super().__init__(num_pages, device)
        # Fresh allocators hand out page 0 first: the stack holds num_pages-1 .. 0, top at the end.
        self._stack = torch.arange(num_pages - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._num_free = num_pages
        self._is_free = torch.ones(num_pages, dtype=torch.bool, device=self.device)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def free_pages(self) -> list[int]:
        """Free page ids in the order `alloc` will hand them out."""
        return self._stack[:self._num_free].flip(0).tolist()

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Boolean tensor: is each of these (in-range) pages free?"""
        return self._is_free[pages.to(self.device)]

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free pages (int64 tensor of ids, top of the stack first); KVCapacityError, and
        nothing taken, when fewer are free; ValueError (TypeError) for a negative `n` (not an int)."""
        check_int("n", n, 0, " (pages to take)")
        if n > self._num_free:
            raise KVCapacityError(f"{n} pages asked for but {self._num_free} of {self.num_pages} are free: "
                                  "free some, evict cached prefixes, or make the pool bigger.")
        top = self._num_free
        taken = self._stack[top - n:top].flip(0)
        self._num_free = top - n
        self._is_free[taken] = False
        return taken

    def free(self, pages: torch.Tensor) -> None:
        """Give back distinct, allocated pages (a 1-D int64 tensor); `pages[0]` is handed out first
        next time. ValueError, and nothing freed, on a page listed twice, outside 0 .. num_pages - 1,
        or already free."""
        if pages.numel() == 0:
            return
        pages = pages.to(self.device)
        check_free_ids(pages, self.num_pages)
        if self._is_free[pages].any():
            bad = pages[self._is_free[pages]][:5].tolist()
            raise ValueError(f"Double free: page(s) {bad} are already free; each page may be freed once per alloc.")
        top = self._num_free
        self._stack[top:top + pages.numel()] = pages.flip(0)
        self._num_free = top + pages.numel()
        self._is_free[pages] = True
