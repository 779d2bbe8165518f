"""`AllocatorBase`: the bookkeeping of a page allocator that chapter 4 does not teach, inherited by
the package's `PageAllocator` (kvlearn/allocator.py, the chapter's answer) and by a learner's
allocator alike (`kvlearn.parts.AllocatorBase` is this class)."""

from __future__ import annotations

import torch

from kvlearn.device import resolve_device
from kvlearn.errors import check_positive_int


class AllocatorBase:
    """The allocator's bookkeeping that chapter 4 does not teach: the checked `num_pages` (page
    ids 0 .. num_pages - 1), the `device`, `num_free` and `is_free` read from your `free_pages`,
    and a repr. Inherit from it, call `super().__init__(num_pages, device)` in your `__init__`,
    then build your free list and write `alloc`, `free` and `free_pages` (override `num_free` and
    `is_free` if you keep a counter and flags: `PageAllocator` does)."""

    def __init__(self, num_pages: int, device=None):
        check_positive_int("num_pages", num_pages)
        self.num_pages = num_pages
        self.device = resolve_device(device)

    @property
    def num_free(self) -> int:
        """How many pages are free."""
        return len(self.free_pages)

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Boolean tensor: is each of these (in-range) pages free?"""
        free = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)
        free[torch.tensor(self.free_pages, dtype=torch.int64, device=self.device)] = True
        return free[pages.to(self.device)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pages={self.num_pages}, free={self.num_free})"
