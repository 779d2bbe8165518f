"""The `radix_cache` part (chapter 3): the radix tree of cached prefixes over pool slots.

The engine's radix mode builds it as `cls(page_size=..., evict_callback=pool.free, device=...)`,
like `kvlearn.RadixCache`, and calls only the members of `RadixCachePart`; pictures also read the
nodes (`RadixNode`). A learner writes match with split, insert, lock / unlock and evict;
`RadixCacheBase` holds the rest.
"""

from __future__ import annotations

import itertools
from typing import Callable, Protocol

import torch

from kvlearn.device import resolve_device
from kvlearn.errors import check_positive_int
from kvlearn.radix import MatchResult, TreeNode, as_slot_value, as_token_key, subtree_nodes


class RadixNode(Protocol):
    """A node as pictures read it: `kvlearn.radix.TreeNode` has these fields (use it).

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


class RadixCacheBase:
    """The tree's bookkeeping that chapter 3 does not teach. Inherit from it and write
    `match_prefix`, `insert`, `lock`, `unlock` and `evict` (and your LRU clock; override `reset`,
    calling `super().reset()`, to clear what you add).

    It gives: the checked constructor arguments (`page_size`, `evict_callback`, `device`); `reset`
    (a fresh `root`) and `new_node(key, value, parent)` (a `kvlearn.radix.TreeNode` with a fresh
    id); the input checks `as_key` (raises on a bad key), `as_value`, `aligned` (whole pages) and
    `child_key` (how `children` are keyed); `nodes()`; and, read from the nodes' `key` and
    `lock_ref`, the sizes, `match_len`, `unlocked_on_path` and `insert_prefix` (insert, then match).
    The sizes recount the tree on every call (O(nodes)); the package's RadixCache keeps counters.
    """

    def __init__(self, page_size: int = 1, evict_callback: Callable[[torch.Tensor], object] | None = None,
                 device: str | torch.device = "cpu"):
        check_positive_int("page_size", page_size, " (tokens per page)")
        if evict_callback is not None and not callable(evict_callback):
            raise TypeError(f"evict_callback must be callable(value_tensor) or None, got {evict_callback!r}.")
        self.page_size, self.evict_callback, self.device = page_size, evict_callback, resolve_device(device)
        self.reset()

    def reset(self) -> None:
        self._ids = itertools.count()
        self.root = self.new_node((), torch.empty(0, dtype=torch.int64, device=self.device), None)

    def new_node(self, key: tuple, value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        return TreeNode(next(self._ids), key, value, parent)

    # --- input checks ---------------------------------------------------------------------------
    def as_key(self, key) -> tuple:
        """`key` as a tuple of token ids; TypeError / ValueError on a bad key."""
        return as_token_key(key)

    def as_value(self, value, n: int) -> torch.Tensor:
        """`value` as a 1-D int64 tensor of `n` slot ids; TypeError / ValueError otherwise."""
        return as_slot_value(value, n, self.device)

    def aligned(self, key: tuple) -> tuple:
        """The whole pages of `key`."""
        return key[:len(key) // self.page_size * self.page_size]

    def child_key(self, key: tuple):
        """The key of the child an edge starting with `key` hangs under: its first token (page)."""
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    # --- queries read from the nodes -------------------------------------------------------------
    def nodes(self) -> list[TreeNode]:
        return subtree_nodes(self.root)

    @property
    def evictable_size(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.lock_ref == 0)

    @property
    def protected_size(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.lock_ref > 0)

    @property
    def total_size(self) -> int:
        return sum(len(n.key) for n in self.nodes())

    def match_len(self, key) -> int:
        key = self.aligned(self.as_key(key))
        node, i, p = self.root, 0, self.page_size
        while i < len(key):
            child = node.children.get(self.child_key(key[i:]))
            if child is None:
                return i
            m = 0
            while m < len(child.key) and child.key[m:m + p] == key[i + m:i + m + p]:
                m += p
            i += m
            if m < len(child.key):
                return i
            node = child
        return i

    def unlocked_on_path(self, node) -> int:
        tokens = 0
        while node is not None and node.lock_ref == 0:
            tokens += len(node.key)
            node = node.parent
        return tokens

    def insert_prefix(self, key, value) -> tuple[int, MatchResult]:
        return self.insert(key, value), self.match_prefix(key)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(page_size={self.page_size}, nodes={len(self.nodes())}, "
                f"total={self.total_size}, evictable={self.evictable_size}, protected={self.protected_size})")
