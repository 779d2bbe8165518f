"""A radix tree over token ids that maps cached prefixes to KV slot indices (chapter 3).

Each edge holds a run of tokens (`TreeNode.key`) and the pool slots where their K and V live
(`TreeNode.value`, int64, same length). A request's prompt is matched from the root; the slots
along the matched path are KV that need not be computed again.

Invariants, kept by every public method:
- every node except the root holds at least one page of tokens, and `len(key) == len(value)`,
  both a multiple of `page_size`; children are keyed by their first token (first page when
  `page_size > 1`), so two children of one node never start with the same token (page);
- `lock_ref` of a node = its `own_locks` (locks taken on exactly this node) + the `lock_ref` of
  its children, so it is >= theirs, and the root's counts every lock held; only a node with
  `own_locks > 0` can be unlocked (SGLang and mini-sglang stop locking below the root; kvlearn
  counts the root too, which changes no size: the root holds no tokens);
- `evictable_size` = tokens in nodes with lock_ref 0, `protected_size` = tokens in nodes with
  lock_ref > 0, and `total_size` = their sum = tokens in the tree;
- only unlocked leaves are evicted, smallest eviction key first. The key is the eviction policy's
  function of the node: "lru" (the default) is `last_access`, a logical clock that ticks once per
  `match_prefix` or `insert` call (no wall time: the same calls give the same evictions); "lfu" is
  `(hits, last_access)`; ties go to the older node id. `match_len` is a pure query: it neither
  splits nor ticks nor counts a hit.

Extension points, public on purpose (chapter 8's tiered tree is built on them and on nothing else),
each documented where it is defined: `TreeNode`'s fields for KV below the device (this tree leaves
them at their defaults), `as_key`, `can_evict`, `evict_node`, `eviction_key`, `requeue`,
`remove_leaf` and `on_split`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from operator import attrgetter

import torch

from kvlearn.errors import check_choice, check_int
from kvlearn.radix_base import MatchResult, RadixCacheBase, TreeNode

__all__ = ["EVICTION_POLICIES", "MatchResult", "RadixCache", "TreeNode"]


# Eviction policies: a node's eviction key, smallest evicted first (the heap breaks ties by node id).
EVICTION_POLICIES: dict[str, Callable[[TreeNode], object]] = {
    "lru": attrgetter("last_access"),          # least recently used first
    "lfu": attrgetter("hits", "last_access"),  # fewest hits first, least recently used among equals
}


class RadixCache(RadixCacheBase):
    """Longest-prefix cache of token ids -> KV slot ids, with locking and eviction (LRU by default).

    page_size: tokens per page; with page_size > 1 only whole pages are matched and inserted.
    evict_callback: called with the value tensor (slot ids) of every evicted node, so the KV pool
    can take those slots back. device: where slot tensors live (pass the KV pool's device).
    eviction_policy: which unlocked leaf goes first: a name of EVICTION_POLICIES ("lru", "lfu"), or
    a function node -> key (smallest first; keys must compare with each other) built from
    `last_access`, `hits` and `id`. The heap keeps each leaf's key from the last match, insert,
    unlock or eviction that touched it, and those three change only then (a split shortens a
    leaf's `key` without touching it, so `len(node)` is not a safe ingredient).

    The engine's flow for one request:
        m = cache.match_prefix(prompt); cache.lock(m.last_node)       # reuse m.indices
        ... compute the rest, slots come from the pool ...
        n = cache.insert(tokens, slots)        # tokens = prompt + output[:-1]; slots[:len(m)] = m.indices
        pool.free(slots[len(m):n])             # our copies of tokens someone inserted meanwhile
        pool.free(slots[len(tokens) // page_size * page_size:])   # unaligned tail (pages > 1)
        cache.unlock(m.last_node)
    To keep the inserted path protected while the request goes on (a prompt inserted right after
    its prefill, while it still decodes), `n, m2 = cache.insert_prefix(tokens, slots)` also returns
    the match of the whole inserted key: switch to `m2.indices` and move the lock from
    `m.last_node` to `m2.last_node` (no second walk).

    From `RadixCacheBase` (kvlearn/radix_base.py, the base a learner's tree inherits too): the checks
    of arguments and keys, the root and node ids, `nodes()`, `match_len` and `unlocked_on_path`.
    """

    def __init__(self, page_size: int = 1, evict_callback: Callable[[torch.Tensor], object] | None = None,
                 device: str | torch.device = "cpu", eviction_policy: str | Callable[[TreeNode], object] = "lru"):
        super().__init__(page_size, evict_callback, device)
        if isinstance(eviction_policy, str):
            self.eviction_policy = check_choice("eviction_policy", eviction_policy, EVICTION_POLICIES)
            self._key = EVICTION_POLICIES[eviction_policy]  # node -> eviction key, smallest evicted first
        elif callable(eviction_policy):
            self.eviction_policy, self._key = getattr(eviction_policy, "__name__", "custom"), eviction_policy
        else:
            raise TypeError(f"eviction_policy must be a name ({', '.join(EVICTION_POLICIES)}) or a function "
                            f"node -> key, got {type(eviction_policy).__name__}.")

    def reset(self) -> None:
        super().reset()
        self._nodes = {self.root.id: self.root}  # id -> node, for membership checks and stale heap entries
        self._heap: list[tuple] = []  # (eviction key, id) of unlocked leaves; may hold stale entries
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    # --- sizes: the base's, kept as counters instead of recounted ------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def clock(self) -> int:
        """The logical clock (module docstring); a node's `last_access` is its value at its last touch."""
        return self._clock

    @property
    def eviction_heap(self) -> list[tuple]:
        """A sorted copy of the eviction heap: (eviction key, node id) of every unlocked leaf, plus
        stale entries of nodes touched, locked or removed since (rebuilt when they outnumber the rest)."""
        return sorted(self._heap)

    def __repr__(self) -> str:
        text = super().__repr__()
        return text if self.eviction_policy == "lru" else f"{text[:-1]}, eviction_policy={self.eviction_policy})"

    # --- lookups ------------------------------------------------------------------------------
    def match_prefix(self, key) -> MatchResult:
        """Longest cached prefix of `key` (whole pages only). Splits the edge where the match ends
        inside it, so `last_node` ends exactly at the matched length; touches the matched path and
        counts a hit on each of its nodes."""
        key = self.aligned(self.as_key(key))
        self._clock += 1
        node, _, values = self._walk(key, hit=1)
        self.requeue(node)
        return MatchResult(torch.cat(values), node)

    def insert(self, key, value) -> int:
        """Cache `value[i]` as the slot of `key[i]`; return how many leading tokens were already
        cached (their slots in `value` are duplicates the caller frees). With page_size > 1 only
        the page-aligned head is stored; the caller also frees `value[aligned_length:]`.
        The tree keeps its own copy of the new slots."""
        return self.insert_prefix(key, value)[0]

    def insert_prefix(self, key, value) -> tuple[int, MatchResult]:
        """The base's `insert_prefix` (`insert`, and the match of the whole aligned key after it) in
        one walk; `insert` is built on it."""
        key = self.as_key(key)
        value = self.as_value(value, len(key))
        key = self.aligned(key)
        self._clock += 1
        node, matched, values = self._walk(key, hit=0)
        if matched < len(key):
            leaf = self.new_node(key[matched:], value[matched:len(key)].clone(), node)
            leaf.last_access = self._clock
            node.children[self.child_key(leaf.key)] = leaf
            self._nodes[leaf.id] = leaf
            self._evictable += len(leaf.key)
            values.append(leaf.value)
            node = leaf
        self.requeue(node)
        return matched, MatchResult(torch.cat(values), node)

    def _walk(self, key: tuple, hit: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` down from the root; return the last node, the matched length and the
        values along the path, the root's (empty) first. Touches every node it enters (adding `hit`
        to its hits) and splits a partly matched edge."""
        node, i, n, p = self.root, 0, len(key), self.page_size
        values = [self.root.value]
        while i < n:
            child = node.children.get(self.child_key(key[i:i + p]))
            if child is None:
                break
            edge = child.key
            m = len(edge)
            if key[i:i + m] != edge:  # the match ends inside this edge: cut it there
                child = self._split(child, self.edge_match_len(edge, key, i))
                m = len(child.key)
            child.last_access = self._clock
            child.hits += hit
            values.append(child.value)
            node, i = child, i + m
        return node, i, values

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after k tokens; the new upper node inherits lock_ref, last_access and
        hits, and `child` (the same object, so locks held on it stay right) keeps the rest."""
        parent = child.parent
        upper = self.new_node(child.key[:k], child.value[:k], parent)
        upper.lock_ref, upper.last_access, upper.hits = child.lock_ref, child.last_access, child.hits
        parent.children[self.child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[k:], child.value[k:], upper
        upper.children[self.child_key(child.key)] = child
        self._nodes[upper.id] = upper
        self.on_split(upper, child)
        return upper

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """Hook: an edge was just cut into `upper` (its first `len(upper)` tokens) and `lower` (the
        rest, the same node object as before). This tree has cut its own fields; a subclass that
        keeps per-token fields of its own (chapter 8: `host_value`) cuts them here. Nothing here."""

    # --- locking ------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (lock_ref += 1 from node up to the root)."""
        self._check_node(node)
        node.own_locks += 1
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlocked_on_path(self, node: TreeNode) -> int:
        """The base's query, on a node of this tree only."""
        self._check_node(node)
        return super().unlocked_on_path(node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; nodes whose lock_ref drops to 0 become evictable again."""
        self._check_node(node)
        if node.own_locks == 0:
            held = f" (lock_ref {node.lock_ref} counts locks on nodes below it)" if node.lock_ref else ""
            raise ValueError(f"unlock: node #{node.id} was not locked itself{held}; unlock exactly the "
                             "node you locked, once for each lock.")
        node.own_locks -= 1
        start = node
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent
        self.requeue(start)

    def _check_node(self, node) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode (e.g. match_prefix(...).last_node), got {type(node).__name__}.")
        if self._nodes.get(node.id) is not node:
            raise ValueError(f"node #{node.id} is not in this tree (evicted, reset, or from another "
                             "cache): lock the last_node of a fresh match_prefix instead.")

    # --- eviction -----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens, smallest eviction key first, or every evictable token
        if there are fewer; return the number freed. Victims: unlocked leaves (`can_evict`), taken by
        `evict_node`; a parent left an unlocked leaf becomes a candidate in turn."""
        check_int("num_tokens", num_tokens, what=" (tokens, not pages)")
        freed = 0
        while freed < num_tokens and self._heap:
            key, node_id = heapq.heappop(self._heap)
            node = self._nodes.get(node_id)
            # Entries go stale when the node was touched again, grew a child, got locked or left.
            if node is None or not self.can_evict(node) or self.eviction_key(node) != key:
                continue
            try:
                freed += self.evict_node(node)
            except BaseException:  # the node is whole (see evict_node) and stays in line
                heapq.heappush(self._heap, (key, node_id))
                raise
        return freed

    def eviction_key(self, node: TreeNode):
        """Query: the eviction policy's key of `node` (smallest evicted first)."""
        return self._key(node)

    def can_evict(self, node: TreeNode) -> bool:
        """Query, and a hook: whether `evict` may take this node now. Here: an unlocked leaf (not
        the root). A subclass that widens it calls `requeue` when a node may have become one."""
        return not node.children and not node.lock_ref and node is not self.root

    def evict_node(self, node: TreeNode) -> int:
        """Mutation, and a hook: evict one node `can_evict` allows; return the slots freed. Here its
        slots go to `evict_callback` first (if that raises, the node stays cached, whole, and nothing
        leaks), then it leaves the tree (`remove_leaf`). An override keeps that rule: if it raises,
        the node is whole and still cached."""
        if self.evict_callback is not None:
            self.evict_callback(node.value)
        self.remove_leaf(node)
        return len(node.key)

    def remove_leaf(self, node: TreeNode) -> None:
        """Mutation: take an unlocked leaf out of the tree; its slots were given back already (by
        `evict_node`, or wherever a subclass keeps them). Its parent may become a candidate."""
        self._check_node(node)
        if node.children or node.lock_ref or node is self.root:
            raise ValueError(f"remove_leaf: node #{node.id} is not an unlocked leaf.")
        parent = node.parent
        del parent.children[self.child_key(node.key)]
        del self._nodes[node.id]
        node.parent = None
        self._evictable -= len(node.key)
        self.requeue(parent)

    def requeue(self, node: TreeNode) -> None:
        """Mutation of the eviction order only: if `can_evict(node)`, give it an entry under its
        current `eviction_key`. Called wherever a node may have become a candidate or changed its
        key: after a walk, an unlock, a removal of its last child (and by a subclass, after changing
        what `can_evict` reads). Stale entries are skipped when popped."""
        if not self.can_evict(node):
            return
        heapq.heappush(self._heap, (self.eviction_key(node), node.id))
        if len(self._heap) > 2 * len(self._nodes) + 64:  # too many stale entries: rebuild, O(1) amortized
            self._heap = [(self.eviction_key(n), n.id) for n in self._nodes.values() if self.can_evict(n)]
            heapq.heapify(self._heap)

    # --- checks for tests and notebooks -------------------------------------------------------
    def check_invariants(self) -> None:
        """Recount everything from the tree and assert the module's invariants (O(tree size))."""
        evictable = protected = 0
        for node in self.nodes():
            assert self._nodes.get(node.id) is node, f"node #{node.id} is not registered"
            assert node.lock_ref >= 0, f"node #{node.id} has lock_ref {node.lock_ref}"
            if node is not self.root:
                assert len(node.key) == node.value.shape[0] > 0, f"node #{node.id}: key/value lengths"
                assert len(node.key) % self.page_size == 0, f"node #{node.id} is not page-aligned"
                assert node.parent.children[self.child_key(node.key)] is node, f"node #{node.id}: bad parent link"
                assert node.parent.lock_ref >= node.lock_ref, f"node #{node.id} locked more than its parent"
            assert node.lock_ref == node.own_locks + sum(c.lock_ref for c in node.children.values()), (
                f"node #{node.id}: lock_ref {node.lock_ref} is not its own locks plus its children's")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert len(self._nodes) == len(self.nodes()), "registered nodes that are not in the tree"
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: counted evictable={evictable}, protected={protected}, "
            f"kept evictable={self._evictable}, protected={self._protected}")
        live = {(self.eviction_key(n), n.id) for n in self._nodes.values() if self.can_evict(n)}
        assert live <= set(self._heap), "an eviction candidate is missing from the eviction heap"
