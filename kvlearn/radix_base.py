"""The radix tree's nodes, and `RadixCacheBase`: the bookkeeping chapter 3 does not teach, inherited
by the package's `kvlearn.RadixCache` (kvlearn/radix.py, the chapter's answer) and by a learner's
tree alike (`kvlearn.parts.RadixCacheBase` is this class).

Every node but the root holds at least one page of tokens, `len(key) == len(value)`; children are
keyed by their first token (first page when `page_size > 1`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvlearn.device import resolve_device
from kvlearn.errors import check_positive_int


class TreeNode:
    """One edge of the tree and the node below it.

    key: tuple of token ids on the edge; value: 1-D int64 tensor of their slot ids; children:
    dict from first token (first page tuple when page_size > 1) to child; lock_ref: requests
    using this node or a node below it; own_locks: those that locked exactly this node; last_access:
    logical time of the last match or insert that walked through it; hits: how many `match_prefix`
    calls walked through it (reused its KV). A node removed from the tree has `parent is None`.

    Where the KV lives, for tiers below the device (chapter 8 sets them; this chapter's tree keeps
    every node's KV in the device pool and leaves them at their defaults): on_device: whether
    `value` is slots of the device pool (False: the node stays in the tree with its KV only on the
    host, and `value` is `host_value`; SGLang's `evicted`); host_value: host slots of a copy of the
    KV (one per token, like `value`), or None (SGLang's `host_value`, `backuped` when set);
    on_disk: its full disk pages were written or read.
    """

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "own_locks", "last_access", "hits",
                 "on_device", "host_value", "on_disk")

    def __init__(self, node_id: int, key: tuple, value: torch.Tensor, parent: TreeNode | None,
                 lock_ref: int = 0, last_access: int = 0, hits: int = 0):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict = {}
        self.lock_ref = lock_ref
        self.own_locks = 0
        self.last_access = last_access
        self.hits = hits
        self.on_device = True
        self.host_value: torch.Tensor | None = None
        self.on_disk = False

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, children={len(self.children)}, "
                f"lock_ref={self.lock_ref}, last_access={self.last_access})")


class MatchResult:
    """What a tree's `match_prefix` found: `indices` (slot ids of the matched tokens, in order),
    `last_node` (the node where the match ends, exactly: a partial edge match was split), and
    `len(result)`, the number of matched tokens. Lock `last_node` while the slots are in use."""

    __slots__ = ("indices", "last_node")

    def __init__(self, indices: torch.Tensor, last_node: TreeNode):
        self.indices = indices
        self.last_node = last_node

    def __len__(self) -> int:
        return self.indices.shape[0]

    def __repr__(self) -> str:
        return f"MatchResult(len={len(self)}, last_node=#{self.last_node.id})"


class RadixCacheBase:
    """The bookkeeping of a radix cache that chapter 3 does not teach. A tree inherits it and writes
    `match_prefix`, `insert`, `lock`, `unlock` and `evict` (and its LRU clock; override `reset`,
    calling `super().reset()`, to clear what it adds).

    It gives: the checked constructor arguments (`page_size`, `evict_callback`, `device`); `reset`
    (a fresh `root`) and `new_node(key, value, parent)` (a `TreeNode` with a fresh id); the input
    checks `as_key` (raises on a bad key) and `as_value`, `aligned` (whole pages), `child_key` (how
    `children` are keyed) and `edge_match_len` (how much of an edge a key matches); `nodes()`; and,
    read from the nodes' `key`, `value` and `lock_ref` without changing them, the sizes,
    `num_nodes`, `match_len`, `unlocked_on_path` and `insert_prefix` (`insert`, then the inserted
    path read back). The sizes recount the tree on every call (O(nodes)); `kvlearn.RadixCache`
    keeps counters instead.
    """

    def __init__(self, page_size: int = 1, evict_callback: Callable[[torch.Tensor], object] | None = None,
                 device: str | torch.device = "cpu"):
        check_positive_int("page_size", page_size, " (tokens per page)")
        if evict_callback is not None and not callable(evict_callback):
            raise TypeError(f"evict_callback must be callable(value_tensor) or None, got {evict_callback!r}.")
        self.page_size, self.evict_callback, self.device = page_size, evict_callback, resolve_device(device)
        self.reset()

    def reset(self) -> None:
        """Drop every node (without calling evict_callback: the caller resets its pool too): a
        fresh root, node ids counted from 0 again."""
        self._ids = itertools.count()
        self.root = self.new_node((), torch.empty(0, dtype=torch.int64, device=self.device), None)

    def new_node(self, key: tuple, value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        """A `TreeNode` with the next id (not hung under `parent` yet: the caller does that)."""
        return TreeNode(next(self._ids), key, value, parent)

    # --- input checks and keys ------------------------------------------------------------------
    def as_key(self, key) -> tuple:
        """Query, and a hook: the tuple of token ids `key` stands for (a list or tuple of ints, or a
        1-D integer tensor), checked: ints >= 0; TypeError or ValueError naming what is wrong. A
        subclass whose keys were checked before may skip the check."""
        if isinstance(key, torch.Tensor):
            if key.dim() != 1 or key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
                raise TypeError(f"key tensor must be 1-D with an integer dtype, got shape "
                                f"{tuple(key.shape)} and dtype {key.dtype}.")
            key = tuple(key.tolist())
        elif isinstance(key, (list, tuple)):
            key = tuple(key)
            bad = set(map(type, key)) - {int}
            if bad:
                raise TypeError(f"key must hold Python ints (token ids), found {sorted(t.__name__ for t in bad)}; "
                                "convert it first, e.g. with .tolist().")
        else:
            raise TypeError(f"key must be a list/tuple of ints or a 1-D int tensor, got {type(key).__name__}.")
        if key and min(key) < 0:
            raise ValueError(f"key holds a negative token id ({min(key)}); token ids are >= 0.")
        return key

    def as_value(self, value, n: int) -> torch.Tensor:
        """`value` checked to be a 1-D integer tensor of `n` slot ids, as int64 on the tree's
        device; TypeError or ValueError otherwise."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a 1-D int64 tensor of slot ids, got {type(value).__name__}.")
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"value must be a 1-D integer tensor of slot ids, got shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}.")
        if value.shape[0] != n:
            raise ValueError(f"value has {value.shape[0]} slot ids but key has {n} tokens: give one slot per token.")
        return value.to(self.device, torch.int64)

    def aligned(self, key: tuple) -> tuple:
        """The whole pages of `key`."""
        p = self.page_size
        return key if p == 1 else key[:len(key) // p * p]

    def child_key(self, key: tuple):
        """The key of the child an edge starting with `key` hangs under: its first token (page)."""
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def edge_match_len(self, edge: tuple, key: tuple, start: int) -> int:
        """How many tokens of `edge` match `key[start:]`, in whole pages, knowing that the first
        page matches and the whole edge does not. Binary search on slice equality: each comparison
        runs in C, so no Python step per token."""
        p = self.page_size
        lo, hi = 1, min(len(edge), len(key) - start) // p  # in pages; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[start:start + mid * p] == edge[:mid * p]:
                lo = mid
            else:
                hi = mid - 1
        return lo * p

    # --- queries read from the nodes --------------------------------------------------------------
    def nodes(self) -> list[TreeNode]:
        """All nodes, root first, depth first, children in token order (deterministic)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return out

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes: what `evict` could free right now."""
        return sum(len(n.key) for n in self.nodes() if n.lock_ref == 0)

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes (on the path of a request in flight)."""
        return sum(len(n.key) for n in self.nodes() if n.lock_ref > 0)

    @property
    def total_size(self) -> int:
        """Tokens held by the tree."""
        return sum(len(n.key) for n in self.nodes())

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return len(self.nodes())

    def cached_path(self, key: tuple) -> tuple[list[TreeNode], int]:
        """Query: follow the aligned `key` down from the root; return the nodes whose whole edge
        it goes through (top down, the root left out) and how many of its tokens are cached (the
        last edge may match in part: those tokens count, its node is not listed). Splits, stamps
        and counts nothing."""
        path, node, i, p = [], self.root, 0, self.page_size
        while i < len(key):
            child = node.children.get(self.child_key(key[i:i + p]))
            if child is None:
                break
            if key[i:i + len(child.key)] != child.key:
                return path, i + self.edge_match_len(child.key, key, i)
            path.append(child)
            node, i = child, i + len(child.key)
        return path, i

    def match_len(self, key) -> int:
        """How many tokens `match_prefix(key)` would match now (whole pages), as a pure query: it
        splits no edge and ticks no clock, so asking (e.g. to order a queue) changes nothing."""
        return self.cached_path(self.aligned(self.as_key(key)))[1]

    def unlocked_on_path(self, node: TreeNode) -> int:
        """Tokens on the path from `node` up to the root that are in unlocked nodes: what
        `lock(node)` would move from evictable to protected. A pure query."""
        tokens = 0
        while node is not None and node.lock_ref == 0:  # locks cover whole paths: stop at the first
            tokens += len(node.key)
            node = node.parent
        return tokens

    def insert_prefix(self, key, value) -> tuple[int, MatchResult]:
        """`insert`, also returning the match of the whole (aligned) key after inserting it: the
        tree's slots for every token and the node to lock while they are in use. `insert` is the
        one walk that changes the tree (it splits where the key ends, stamps and ticks once); it
        returns only a length, so the match is read back from the nodes (`cached_path`: no split,
        stamp, tick or hit). ValueError if `insert` left the key uncached or ending inside an edge
        (an `insert` that does not walk like `match_prefix`). `kvlearn.RadixCache` does both in one walk."""
        present = self.insert(key, value)
        key = self.aligned(self.as_key(key))
        path, cached = self.cached_path(key)
        ends = sum(len(node.key) for node in path)
        if ends != len(key):
            raise ValueError(f"insert_prefix: after insert, {cached} of the key's {len(key)} tokens are cached and "
                             f"a node ends after {ends}: insert must cache the whole key and split the edge "
                             "where it ends, as match_prefix does.")
        indices = (torch.cat([node.value for node in path]) if path
                   else torch.empty(0, dtype=torch.int64, device=self.device))
        return present, MatchResult(indices, path[-1] if path else self.root)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(page_size={self.page_size}, nodes={self.num_nodes}, "
                f"total={self.total_size}, evictable={self.evictable_size}, protected={self.protected_size})")
