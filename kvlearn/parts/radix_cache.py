"""The `radix_cache` part (chapter 3): the radix tree of cached prefixes over pool slots.

The engine's radix mode builds it as `cls(page_size=..., evict_callback=pool.free, device=...)`,
like `kvlearn.RadixCache`, and calls only the members of `RadixCachePart`; pictures also read the
nodes (`RadixNode`). A learner writes match with split, insert, lock / unlock and evict;
`RadixCacheBase` (kvlearn/radix_base.py, re-exported here; `kvlearn.RadixCache` inherits it too)
holds the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvlearn.radix_base import MatchResult, RadixCacheBase

__all__ = ["RadixNode", "RadixCachePart", "RadixCacheBase"]


class RadixNode(Protocol):
    """A node as pictures read it: `kvlearn.radix_base.TreeNode` has these fields (use it).

    `kvlearn.viz.RadixTrace`, `radix_text` and `draw_radix` read these fields and nothing else of a
    node, and of the cache only the members of `RadixCachePart`, so they draw a learner's tree too."""

    id: int                    # unique in the tree, the root's is 0
    key: tuple                 # the token ids on the edge into this node
    value: torch.Tensor        # their slot ids, 1-D int64, len(value) == len(key)
    parent: RadixNode | None   # None for the root (and for a node evicted from the tree)
    children: dict             # first token (first page tuple when page_size > 1) -> child
    lock_ref: int              # locks on this node or below it; > 0 means protected
    last_access: int           # logical time of the last match or insert that walked through it
                               # (LRU's key; the pictures print it as t=)


class RadixCachePart(Protocol):
    """What the engine's radix mode asks of the tree (`kvlearn.serving.cache_modes.RadixKV`).

    Rules (the chapter's): a match splits the edge where it ends, so `last_node` ends exactly at the
    matched length; only whole pages are matched and inserted; `lock(node)` protects the path from
    `node` up to the root until `unlock(node)`; `evict` frees whole unlocked leaves, least recently
    used first, handing each one's slots to `evict_callback`, and a parent left an unlocked leaf
    goes in line too; evictable_size + protected_size == total_size. Bad input (a negative token
    id, a value whose length is not the key's, unlocking a node that was not locked) raises
    TypeError or ValueError and changes nothing.
    """

    page_size: int
    evict_callback: Callable[[torch.Tensor], object] | None
    root: RadixNode

    def match_prefix(self, key) -> MatchResult:
        """Mutation (splits, touches): the longest cached prefix of `key`; `.indices` (1-D int64
        slot ids), `.last_node`, `len(result)`."""

    def match_len(self, key) -> int:
        """Query: how many tokens `match_prefix(key)` would match; splits and touches nothing."""

    def insert(self, key, value: torch.Tensor) -> int:
        """Mutation: cache `value[i]` as the slot of `key[i]`; returns the length already cached."""

    def insert_prefix(self, key, value: torch.Tensor) -> tuple[int, MatchResult]:
        """Mutation: `insert`, and the match of the whole inserted key (what to lock next)."""

    def lock(self, node: RadixNode) -> None:
        """Mutation: protect `node` and its ancestors from eviction."""

    def unlock(self, node: RadixNode) -> None:
        """Mutation: undo one `lock(node)`."""

    def unlocked_on_path(self, node: RadixNode) -> int:
        """Query: tokens from `node` up to the root in unlocked nodes (what `lock(node)` protects)."""

    def evict(self, num_tokens: int) -> int:
        """Mutation: free at least `num_tokens` tokens (or every evictable one); returns how many."""

    @property
    def evictable_size(self) -> int:
        """Query: tokens in unlocked nodes."""

    @property
    def protected_size(self) -> int:
        """Query: tokens in locked nodes."""

    @property
    def total_size(self) -> int:
        """Query: tokens in the tree."""

    def reset(self) -> None:
        """Mutation: drop every node (no callback)."""

    def nodes(self) -> list[RadixNode]:
        """Query: every node, root first, depth first (for pictures)."""
