"""The `allocator` part (chapter 4): the free list of the pool's pages.

The pool builds it as `allocator_cls(num_pages, device=...)` and calls only the members of
`AllocatorPart`; the package's own is `kvlearn.allocator.PageAllocator`. A learner writes the free
list: `alloc`, `free` and `free_pages`; `AllocatorBase` (kvlearn/allocator_base.py, re-exported
here; `PageAllocator` inherits it too) holds the rest.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvlearn.allocator_base import AllocatorBase

__all__ = ["AllocatorPart", "AllocatorBase"]


class AllocatorPart(Protocol):
    """What the pool (and the block manager, for fresh blocks) asks of a page allocator.

    Rules: a page is handed out at most once until it is freed (never twice); `alloc(n)` with fewer
    than `n` free pages raises `kvlearn.KVCapacityError` and takes nothing, and `alloc(n)` with
    n < 0 raises ValueError and changes nothing; `free` of a page that is already free, listed
    twice, or outside 0 .. num_pages - 1 raises ValueError and frees nothing;
    `num_free + pages held by callers == num_pages`. The free list is a stack (chapter 4): a fresh
    allocator hands out 0, 1, 2, ...; `alloc(n)` takes the first `n` of `free_pages`; `free(pages)`
    puts them back in front, `pages[0]` first, so the page freed last is handed out first.
    """

    num_pages: int  # query: pages it manages, ids 0 .. num_pages - 1

    @property
    def num_free(self) -> int:
        """Query: how many pages are free."""

    @property
    def free_pages(self) -> list[int]:
        """Query: the free page ids, in the order `alloc` will hand them out."""

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Query: a bool tensor, is each of these pages free?"""

    def alloc(self, n: int) -> torch.Tensor:
        """Mutation: take `n` (>= 0) free pages; a 1-D int64 tensor of their ids."""

    def free(self, pages: torch.Tensor) -> None:
        """Mutation: give back distinct pages (a 1-D int64 tensor, any number of them) that `alloc`
        handed out; `pages[0]` is handed out first next time."""
