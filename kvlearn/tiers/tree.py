"""Chapter 8: a radix tree whose nodes' KV lives on the device, on the host, or on disk.

Chapter 3's tree forgets an evicted prefix; the next request that needs it computes it again. This
tree keeps it one level down, as SGLang's HiCache does:
- device: chapter 4's pool, where attention reads KV;
- host: a second, larger pool (`kvlearn.tiers.host`). A node the device evicts, with its KV on the
  host, stays in the tree *off the device*, and a match walks through it;
- disk: pages keyed by the chained hash of their prefix (`kvlearn.tiers.disk`), found by hash after
  the tree walk ends, even by a fresh process whose tree is empty.

Write policies: "write_back" copies a node to the host when the device evicts it, and its pages to
disk when it leaves the host; "write_through" copies every inserted node to the host (and disk) at
once, so eviction only frees slots.

Invariants (`check_invariants`, on top of chapter 3's):
- a node is in the tree only while its KV is on the device or the host (or both);
- a node on the device has every ancestor on the device: along a path the device part comes first,
  so a match is a device prefix followed by off-device nodes;
- where a node's KV lives is in chapter 3's per-node fields: `on_device`, `host_value` (its host
  copy, or None), `on_disk`; `value` holds its device slots, or `host_value` while it is off the
  device;
- `evictable_size`, `protected_size` and `total_size` count device tokens, as the pool sees them;
  chapter 3's counts (its `evictable_size`, `protected_size`) cover every node, off-device ones too;
- host conservation: host free slots + host slots held by nodes == host pool size;
- a node is marked `on_disk` only once all its full pages were written (a page the disk could not
  write is dropped, and a later write tries again: the disk is a cache).

Eviction, smallest key of chapter 3's eviction policy first in every tier ("lru" by default):
the device takes unlocked nodes with no child on the device (`can_evict`) to the host, or out of
the tree with everything below them if the host cannot take them (`evict_node`); the host drops
copies of device nodes and unlocked off-device leaves (`_evict_host`). What leaves memory is
written to disk first (`_persist`); a disk with a capacity deletes its least recently used pages.

Faults: each method that moves KV between tiers makes its fallible call (a pool's free, a host
allocation, a disk write) before it changes the tree, so an exception there leaves every tier whole
and a later eviction can try again; `load_back` keeps the lock where it was if it fails (see it).
Each such step starts at a declared fault point (`kvlearn.errors.fault_point`, "tiers.<step>").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlearn.errors import check_choice, fault_point
from kvlearn.pool import KVPool
from kvlearn.radix import MatchResult, RadixCache, TreeNode
from kvlearn.serving.cache_modes import WRITE_POLICIES
from kvlearn.serving.kv_manager import TIER_STATS
from kvlearn.tiers.disk import DiskStore
from kvlearn.tiers.host import copy_kv


class TieredRadixCache(RadixCache):
    """A RadixCache over a device pool with an optional host pool and disk store below it.

    eviction_policy: chapter 3's ("lru", "lfu" or a function node -> key), for the device and the
    host alike. `stats`: offloaded_tokens (tokens copied down to the host or written to disk, each
    copy counted), loaded_from_host_tokens, loaded_from_disk_tokens (tokens brought back to the device).
    """

    def __init__(self, pool: KVPool, host: KVPool | None = None, disk: DiskStore | None = None,
                 write_policy: str = "write_back", eviction_policy: str | Callable[[TreeNode], object] = "lru"):
        check_choice("write_policy", write_policy, WRITE_POLICIES)
        if host is not None and host.page_size != pool.page_size:
            raise ValueError(f"the host pool's page_size ({host.page_size}) must be the device pool's "
                             f"({pool.page_size}): build it with kvlearn.tiers.host.host_pool_for.")
        if disk is not None and disk.page_tokens % pool.page_size:
            raise ValueError(f"a disk page ({disk.page_tokens} tokens) must be whole device pages of "
                             f"{pool.page_size}: give the DiskStore a multiple of {pool.page_size}.")
        self.pool, self.host, self.disk, self.write_policy = pool, host, disk, write_policy
        self.stats = dict.fromkeys(TIER_STATS, 0)
        super().__init__(page_size=pool.page_size, evict_callback=pool.free, device=pool.device,
                         eviction_policy=eviction_policy)

    def reset(self) -> None:
        """Drop every node, as chapter 3's reset (the caller resets its pools too)."""
        super().reset()
        self._backed: dict[int, TreeNode] = {}     # id -> node with a host copy (`host_value`)
        self._off_unlocked = self._off_locked = 0  # off-device tokens, by lock state

    # --- where KV lives -----------------------------------------------------------------------
    def tiers(self, node: TreeNode) -> tuple[str, ...]:
        """Where this node's KV is: some of "device", "host", "disk" (disk: its pages were written
        or read, and every full page that ends inside it is still there, not evicted since)."""
        on_disk = node.on_disk and all(map(self.disk.contains, self._disk_keys(node)[0]))
        return tuple(name for name, here in (("device", node.on_device), ("host", node.host_value is not None),
                                             ("disk", on_disk)) if here)

    @property
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes: what `evict` could free in the pool right now."""
        return super().evictable_size - self._off_unlocked

    @property
    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return super().protected_size - self._off_locked

    @property
    def total_size(self) -> int:
        """Tokens of the tree on the device."""
        return self.evictable_size + self.protected_size

    @property
    def off_device_size(self) -> int:
        """Tokens of the tree kept only on the host."""
        return self._off_unlocked + self._off_locked

    @property
    def host_size(self) -> int:
        """Tokens with a copy on the host (off-device ones and copies of device ones)."""
        return sum(map(len, self._backed.values()))

    def __repr__(self) -> str:
        return (f"TieredRadixCache({self.write_policy}, nodes={self.num_nodes}, device={self.total_size}, "
                f"host={self.host_size}, off_device={self.off_device_size}, "
                f"disk_files={len(self.disk.files()) if self.disk else 0})")

    # --- matching, loading back, inserting -----------------------------------------------------
    def match_prefix(self, key) -> MatchResult:
        """Chapter 3's match over every tier: `last_node` ends the whole match; `indices` (and
        `len`) are the device part, the head of the path. `load_back` brings the rest."""
        match = super().match_prefix(key)
        tail, above = self._off_device_tail(match.last_node)
        if tail:  # the walk touched the device node above the off-device tail: renew its entry
            self.requeue(above)
        return MatchResult(match.indices[:len(match) - sum(map(len, tail))], match.last_node)

    def reachable_len(self, key) -> int:
        """Tokens of `key` that `match_prefix` + `load_back` would put on the device now, if every
        disk file found is valid (a pure query: nothing splits, ticks or loads)."""
        start = self.match_len(key)
        if self.disk is None:
            return start
        p, hashes = self.disk.page_tokens, self.disk.entry_keys(self.as_key(key))
        missing = next((i for i in range(start // p, len(hashes)) if not self.disk.contains(hashes[i])), len(hashes))
        return max(start, missing * p)  # the pages before the first one missing continue the match

    def load_back(self, key, node: TreeNode, slots: torch.Tensor) -> tuple[int, TreeNode]:
        """Bring a locked match onto the device before the forward that reads it. `node` is the
        match's locked `last_node`; `slots` are device slots for `key`, the match's device part at
        their head and fresh slots after. Copies the path's off-device nodes from the host into
        their slots, then whole disk pages that continue the path; moves the lock to the end of what
        was loaded. Returns (tokens of `key` now on the device, the locked node).

        If it raises, `node` still holds the lock, and the tree holds on the device a head of
        `slots` along `key` (nodes brought back before the failure): `device_head(key, slots)`
        tokens; the rest of `slots` is still the caller's."""
        path = self._path(node)
        for x, at in self._off_device_offsets(path):
            dst = slots[at:at + len(x)]
            copy_kv(self.host, x.value, self.pool, dst)
            self._to_device(x, dst.clone())
            self.stats["loaded_from_host_tokens"] += len(x)
        offset = sum(map(len, path))
        end = self._load_disk(list(key), offset, slots)
        if end == offset:
            return offset, node
        _, match = self.insert_prefix(list(key[:end]), slots[:end])  # the path is on the device now
        loaded = match.last_node
        loaded.on_disk = True
        self.lock(loaded)
        try:
            self.unlock(node)
        except BaseException:  # the lock stays where it was
            self.unlock(loaded)
            raise
        return end, loaded

    def device_head(self, key, slots: torch.Tensor) -> int:
        """How many leading tokens of `key` the tree holds on the device in exactly `slots` (a pure
        query: after a failed `load_back`, the part of `slots` the tree has adopted)."""
        i = 0
        for x in self.cached_path(self.aligned(self.as_key(key)))[0]:  # the nodes `key` goes through
            if not x.on_device or not torch.equal(x.value, slots[i:i + len(x)].to(x.value.device)):
                break
            i += len(x)
        return i

    def _load_disk(self, key: list, start: int, slots: torch.Tensor) -> int:
        """Read the valid disk pages that continue key[:start] into `slots` (those that fit in it: the
        caller sized it by `reachable_len`, and a file found bad may have become readable since);
        return the new end."""
        fault_point("tiers.load_disk")
        if self.disk is None:
            return start
        p, hashes, end = self.disk.page_tokens, self.disk.entry_keys(key), start
        for i in range(start // p, min(len(hashes), len(slots) // p)):
            kv = self.disk.get(hashes[i], key[i * p:(i + 1) * p])
            if kv is None:
                break
            lo = max(start, i * p)  # a page that starts inside the match: keep only its new tokens
            self.pool.kv.index_copy_(2, slots[lo:(i + 1) * p], kv[:, :, lo - i * p:].to(self.pool.device))
            end = (i + 1) * p
        self.stats["loaded_from_disk_tokens"] += end - start
        return end

    def insert_prefix(self, key, value) -> tuple[int, MatchResult]:
        """Chapter 3's insert, where off-device nodes on the path adopt the caller's slots (the same
        tokens after the same prefix: the same KV, already computed) rather than count as present.
        Returns (leading tokens whose slots in `value` are duplicates, the match of the whole key);
        with write_through, every node of the path is then copied down."""
        present, match = super().insert_prefix(key, value)  # it checked `value`
        path = self._path(match.last_node)
        off = list(self._off_device_offsets(path))  # a new leaf may follow them
        if off:
            present, slots = off[0][1], value.to(self.device, torch.int64)  # present: the device head
            for x, at in off:
                self._to_device(x, slots[at:at + len(x)].clone())
            match = MatchResult(torch.cat([x.value for x in path]), match.last_node)
            self.requeue(match.last_node)  # on the device now: it may have become a candidate
        if self.write_policy == "write_through":
            for x in path:
                if x.host_value is None:
                    self._backup(x)
                self._persist(x)
        return present, match

    def _to_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        """An off-device node now has its KV in these device slots (its host copy stays)."""
        fault_point("tiers.to_device")
        node.on_device, node.value = True, slots
        if node.lock_ref:
            self._off_locked -= len(node.key)
        else:
            self._off_unlocked -= len(node.key)

    # --- locking: off-device tokens change lock state too ---------------------------------------
    def unlocked_on_path(self, node: TreeNode) -> int:
        """Device tokens that `lock(node)` would move from evictable to protected (a pure query)."""
        return super().unlocked_on_path(node) - sum(len(x) for x in self._off_device_tail(node)[0] if not x.lock_ref)

    def lock(self, node: TreeNode) -> None:
        super().lock(node)
        self._count_lock_change(node, now=1)

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        # The device node above an off-device tail may have become an eviction candidate.
        self.requeue(self._count_lock_change(node, now=0))

    def _count_lock_change(self, node: TreeNode, now: int) -> TreeNode:
        """After a lock (now=1) or unlock (now=0) of `node`: off-device nodes on its path whose
        lock_ref became `now` changed lock state. They are the tail of the path; returns the
        device node above them."""
        tail, above = self._off_device_tail(node)
        moved = sum(len(x) for x in tail if x.lock_ref == now) * (1 if now else -1)  # unlocked -> locked
        self._off_locked += moved
        self._off_unlocked -= moved
        return above

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """Chapter 3's hook: the upper part of a cut edge lives where the edge lived."""
        upper.on_device, upper.on_disk = lower.on_device, lower.on_disk
        if lower.host_value is not None:
            k = len(upper.key)
            upper.host_value, lower.host_value = lower.host_value[:k], lower.host_value[k:]
            self._backed[upper.id] = upper

    # --- device eviction: demote ---------------------------------------------------------------
    def can_evict(self, node: TreeNode) -> bool:
        """Chapter 3's hook: the device evicts unlocked device nodes with no child on the device."""
        return (node.on_device and not node.lock_ref and node is not self.root
                and not any(c.on_device for c in node.children.values()))

    def evict_node(self, node: TreeNode) -> int:
        """Chapter 3's hook: take a candidate off the device, to the host (copied there first if it
        has no copy) or, if the host cannot take it, out of the tree with its off-device subtree.
        Returns the device slots freed."""
        fault_point("tiers.evict_device")
        n = len(node.key)
        if node.host_value is not None or self._backup(node):
            self._demote(node)
        else:  # no room in memory below the device: it leaves, with its off-device subtree
            self._remove(node)
        return n

    def _demote(self, node: TreeNode) -> None:
        """Free an unlocked device node's slots; its host copy becomes its KV (off the device)."""
        self.pool.free(node.value)  # the one call that may fail: then nothing has changed
        node.on_device, node.value = False, node.host_value
        self._off_unlocked += len(node.key)
        self.requeue(node.parent)

    # --- host eviction ---------------------------------------------------------------------------
    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to the host, evicting host copies to make room; False when there
        is no host tier or it cannot make room."""
        fault_point("tiers.backup")
        n = len(node.key)
        if self.host is None or n > self.host.num_slots:
            return False
        if self.host.num_free < n:
            self._evict_host(n - self.host.num_free)
        if self.host.num_free < n:
            return False
        slots = self.host.alloc(n)
        copy_kv(self.pool, node.value, self.host, slots)
        node.host_value = slots
        self._backed[node.id] = node
        self.stats["offloaded_tokens"] += n
        return True

    def _evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots, smallest eviction key first: drop host copies of
        device nodes, take unlocked off-device leaves out of the tree. Returns slots freed."""
        fault_point("tiers.evict_host")
        freed = 0
        while freed < num_tokens:
            candidates = [x for x in self._backed.values() if x.on_device or not (x.children or x.lock_ref)]
            if not candidates:
                break
            victim = min(candidates, key=lambda x: (self.eviction_key(x), x.id))
            if victim.on_device:
                self.host.free(victim.host_value)  # freed first: if it fails, the copy is still held
                victim.host_value = None
                del self._backed[victim.id]
            else:
                self._remove(victim)
            freed += len(victim.key)
        return freed

    def _remove(self, node: TreeNode) -> None:
        """Take an unlocked node and everything below it out of the tree, children first, writing
        their pages to disk (if there is one) and giving back their slots in every tier."""
        fault_point("tiers.remove")
        for child in list(node.children.values()):
            self._remove(child)
        self._persist(node, leaving=True)
        # Slots go back before the node leaves, one tier at a time, so a failing free leaves a
        # whole node (on the host only, after the device's free) that a later eviction takes again.
        if node.on_device:
            if node.host_value is not None:
                self._demote(node)
            else:
                self.pool.free(node.value)
        if node.host_value is not None:
            self.host.free(node.host_value)
        self.remove_leaf(node)
        self._backed.pop(node.id, None)
        if not node.on_device:
            self._off_unlocked -= len(node.key)

    # --- disk ----------------------------------------------------------------------------------
    def _persist(self, node: TreeNode, leaving: bool = False) -> None:
        """Write to disk every full page that ends inside this node and is not there yet (a page
        that starts in an ancestor takes those tokens' KV from the ancestor). A node written once
        is skipped, unless it is `leaving` memory: then pages already on disk are stamped as just
        used (the disk's LRU counts this write-back as a use), and pages the disk has evicted since
        (or found bad, by a read or by their header) are written again."""
        fault_point("tiers.persist")
        if self.disk is None or (node.on_disk and not leaving):
            return
        keys, path, tokens = self._disk_keys(node)
        p = self.disk.page_tokens
        first = (len(tokens) - len(node.key)) // p
        written = True  # every page is on disk: a page the disk refused (an OS error) is dropped
        for i, key in enumerate(keys, start=first):
            page = tokens[i * p:(i + 1) * p]
            if not self.disk.holds(key, page):  # absent, or bad (known, or seen in its header)
                if self.disk.put(key, page, self._gather(path, i * p, (i + 1) * p)):
                    self.stats["offloaded_tokens"] += p
                else:
                    written = False
            elif leaving:
                self.disk.touch(key)
        if written:  # else the next persist of this node tries again
            node.on_disk = True

    def flush(self) -> int:
        """Write to disk every full page of the tree not there yet, from whichever tier holds it (a
        clean exit under write_back, whose disk gets only what leaves memory). Returns tokens
        written; idempotent: a second call writes nothing (unless the disk refused some before)."""
        before = self.stats["offloaded_tokens"]
        for node in self.nodes()[1:]:
            self._persist(node)
        return self.stats["offloaded_tokens"] - before

    def _disk_keys(self, node: TreeNode) -> tuple[list[int], list[TreeNode], list[int]]:
        """The disk keys of the full pages that end inside `node`, its path and the path's tokens."""
        path = self._path(node)
        tokens = [t for x in path for t in x.key]
        if self.disk is None:
            return [], path, tokens
        p = self.disk.page_tokens
        hashes = self.disk.entry_keys(tokens)
        return hashes[(len(tokens) - len(node.key)) // p:], path, tokens

    def _gather(self, path: list[TreeNode], start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end) of a path, read from whichever tier holds each node."""
        parts, offset = [], 0
        for x in path:
            lo, hi = max(start, offset), min(end, offset + len(x.key))
            if lo < hi:
                pool = self.pool if x.on_device else self.host
                parts.append(pool.kv.index_select(2, x.value[lo - offset:hi - offset].to(pool.device)).cpu())
            offset += len(x.key)
        return torch.cat(parts, dim=2)

    def _off_device_tail(self, node: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """The off-device nodes that end `node`'s path, bottom up, and the device node (maybe the
        root) above them."""
        tail = []
        while node is not self.root and not node.on_device:
            tail.append(node)
            node = node.parent
        return tail, node

    def _off_device_offsets(self, path: list[TreeNode]):
        """(x, where x's tokens start in the path) for each off-device node x of `path`, top down."""
        offset = 0
        for x in path:
            if not x.on_device:
                yield x, offset
            offset += len(x)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from below the root down to `node`."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    # --- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        super().check_invariants()  # chapter 3's, with this tree's eviction candidates
        off = {False: 0, True: 0}
        host_tokens = backed = 0
        for node in self.nodes()[1:]:
            n = len(node.key)
            assert node.on_device or node.host_value is not None, f"node #{node.id} holds KV in no tier"
            if node.on_device:
                assert node.parent is self.root or node.parent.on_device, (
                    f"node #{node.id} is on the device but its parent is not")
            else:
                off[bool(node.lock_ref)] += n
                assert torch.equal(node.value, node.host_value), f"off-device node #{node.id}: value"
            if node.host_value is not None:
                assert self._backed.get(node.id) is node, f"node #{node.id}: host copy not registered"
                assert node.host_value.shape[0] == n, f"node #{node.id}: host copy length"
                host_tokens += n
                backed += 1
        assert backed == len(self._backed), "a host copy of a node that left the tree"
        assert (off[False], off[True]) == (self._off_unlocked, self._off_locked), "off-device sizes drifted"
        if self.host is not None:
            assert self.host.num_free + host_tokens == self.host.num_slots, "host slot leak"
