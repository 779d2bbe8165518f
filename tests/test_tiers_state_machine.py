"""TieredRadixCache against a brute-force reference, driven by hypothesis (as chapter 3's tree is).

Every token's K and V in the pools is a marker computed from its whole prefix, so wherever a
prefix's KV travels (device -> host -> disk -> device), reading it back proves it is the right KV.
The reference knows nothing about nodes: it keeps the set of page-aligned prefixes the tree holds in
memory. A prefix appears only by an insert or a load back; it may disappear only if no lock covers
it, and then (with a disk) its full pages are on disk and read back as the right KV. A match finds
exactly the longest prefix of the set; device eviction takes the least recently used candidates.

The disk may have a capacity of a few pages. A reference LRU clock (every write, valid read and
touch) checks each of the store's evictions: the least recently used files go, only as many as the
new one needs, and the folder never holds more than the capacity after a write. A restart (a new
tree, pools and store on the same folder) keeps the order.
"""

import itertools
import os
import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn.pool import KVPool
from kvlearn.tiers import DiskStore, TieredRadixCache
from kvlearn.tiers.host import host_pool_for

tokens = st.lists(st.integers(0, 2), max_size=10)


class RecordingDisk(DiskStore):
    """A DiskStore checked against a reference LRU order. `used`: key -> tick of its last write,
    valid read or touch (shared across restarts, as the folder is); `evicted`: keys the store
    deleted and has not written since; `corrupted`: keys the test damaged and nobody rewrote."""

    def __init__(self, *args, used, evicted, corrupted, **kwargs):
        super().__init__(*args, **kwargs)
        self.used, self.evicted, self.corrupted = used, evicted, corrupted
        self.ticks = itertools.count(max(used.values(), default=0) + 1)

    def on_disk(self) -> dict[int, int]:
        return {int(p.stem, 16): p.stat().st_size for p in self.files()}

    def put(self, key, tokens, kv):
        before = self.on_disk()
        super().put(key, tokens, kv)
        after = self.on_disk()
        gone = set(before) - set(after)
        assert key not in gone and set(after) == set(before) - gone | {key}, "a put touched other files"
        if self.max_bytes is None:
            assert not gone
        else:
            assert sum(after.values()) <= self.max_bytes, "over capacity after a write"
            kept = set(after) - {key}
            if gone:
                assert max(self.used[k] for k in gone) < min((self.used[k] for k in kept), default=float("inf")), (
                    "the disk did not evict the least recently used entries")
                newest_gone = max(gone, key=self.used.__getitem__)
                assert sum(after[k] for k in kept) + before[newest_gone] + after[key] > self.max_bytes, (
                    "the disk evicted more than the new entry needed")
        for k in gone:
            del self.used[k]
        self.evicted |= gone
        self.evicted.discard(key)
        self.corrupted.discard(key)
        self.used[key] = next(self.ticks)

    def get(self, key, tokens):
        kv = super().get(key, tokens)
        if kv is not None:
            self.used[key] = next(self.ticks)
        return kv

    def touch(self, key):
        super().touch(key)
        if key in self.used:
            self.used[key] = next(self.ticks)


def marker(prefix) -> float:
    """The KV 'value' of the last token of `prefix`: a function of the whole prefix."""
    h = 0
    for t in prefix:
        h = (h * 7 + t + 1) % 10_007
    return float(h)


class TieredMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 1, 2]), host_slots=st.sampled_from([0, 4, 8, 24]),
                use_disk=st.booleans(), policy=st.sampled_from(["write_back", "write_through"]),
                disk_pages=st.sampled_from([None, 1, 2, 4]))
    def setup(self, page, host_slots, use_disk, policy, disk_pages):
        self.page, self.host_slots, self.policy, self.disk_pages = page, host_slots, policy, disk_pages
        self.folder = tempfile.mkdtemp(prefix="kvlearn-tiers-")
        self.used, self.evicted = {}, set()  # the disk's reference LRU clock and evictions
        self.corrupted = set()  # disk keys we damaged (and nobody rewrote)
        self.keys = []         # keys inserted so far, to match again
        self.build(use_disk)

    def build(self, use_disk):
        """Fresh pools, store and tree (on the same folder after a restart)."""
        self.pool = KVPool(1, 1, 1, 12, page_size=self.page)
        self.host = host_pool_for(self.pool, self.host_slots) if self.host_slots else None
        self.disk = None
        if use_disk:
            shape, p = (1, 1, 1), 2 * self.page
            entry = DiskStore(self.folder, "toy", torch.float32, shape, p).max_entry_bytes
            self.disk = RecordingDisk(self.folder, "toy", torch.float32, shape, p, used=self.used,
                                      evicted=self.evicted, corrupted=self.corrupted,
                                      max_bytes=self.disk_pages and self.disk_pages * entry)
        self.tree = TieredRadixCache(self.pool, self.host, self.disk, self.policy)
        self.present = set()   # reference: page-aligned prefixes held in memory (device or host)
        self.locks = []        # (node, locked prefix)

    def teardown(self):
        if hasattr(self, "folder"):
            shutil.rmtree(self.folder, ignore_errors=True)

    # --- helpers -----------------------------------------------------------------------------
    def aligned(self, key):
        return tuple(key[:len(key) // self.page * self.page])

    def pages(self, key):
        return [key[:j] for j in range(self.page, len(key) + 1, self.page)]

    def tree_present(self):
        out, path = set(), {self.tree.root.id: ()}
        for node in self.tree.nodes()[1:]:
            path[node.id] = path[node.parent.id] + node.key
            base = path[node.parent.id]
            out.update(base + node.key[:j] for j in range(self.page, len(node.key) + 1, self.page))
        return out

    def device_free(self, n):
        if self.pool.num_free < n:
            self.tree.evict(n - self.pool.num_free)
        return self.pool.num_free >= n

    def locked(self, prefix):
        return any(lp[:len(prefix)] == prefix for _, lp in self.locks)

    def expect_changes(self, added):
        """After an operation: the tree holds the reference plus exactly `added`, minus prefixes
        that legitimately left (no lock covers them; their disk pages are on disk)."""
        now = self.tree_present()
        assert now - self.present <= set(added), f"prefixes appeared from nowhere: {now - self.present - set(added)}"
        assert set(added) <= now, "an inserted or loaded prefix is missing"
        gone = self.present - now
        for prefix in gone:
            assert not self.locked(prefix), f"locked prefix {prefix} left the tree"
            if self.disk is not None and len(prefix) % self.disk.page_tokens == 0:
                self.assert_on_disk(prefix)
        self.present = now

    def assert_on_disk(self, prefix):
        key = self.disk.entry_keys(prefix)[-1]
        if key in self.corrupted or key in self.evicted:  # damaged, or deleted for room (checked at the put)
            return
        kv = self.disk.get(key, prefix[-self.disk.page_tokens:])
        assert kv is not None, f"{prefix} left memory but is not on disk"
        p = self.disk.page_tokens
        want = [marker(prefix[:len(prefix) - p + i + 1]) for i in range(p)]
        assert kv[0, 0, :, 0, 0].tolist() == want and kv[0, 1, :, 0, 0].tolist() == [-w for w in want]

    def write_markers(self, key, slots, start=0):
        values = torch.tensor([marker(key[:i + 1]) for i in range(start, start + len(slots))])
        self.pool.kv[0, 0, slots, 0, 0] = values
        self.pool.kv[0, 1, slots, 0, 0] = -values

    # --- rules -------------------------------------------------------------------------------
    @rule(key=tokens)
    def insert(self, key):
        key = tuple(key)
        n = -(-len(key) // self.page) * self.page
        room = self.device_free(n)
        self.expect_changes(())  # making room may have moved or dropped prefixes
        if not room:
            return
        taken = self.pool.alloc(n)
        self.write_markers(key, taken[:len(key)])
        _, match = self.tree.insert_prefix(list(key), taken[:len(key)])
        a = len(match)
        mine = taken[:a]
        self.pool.free(torch.cat([mine[mine != match.indices], taken[a:]]))  # duplicates, unaligned tail
        self.expect_changes(self.pages(self.aligned(key)))
        self.keys.append(key)
        if self.tree.write_policy == "write_through" and self.disk is not None:
            for prefix in self.pages(self.aligned(key)):
                if len(prefix) % self.disk.page_tokens == 0:
                    self.assert_on_disk(prefix)

    @rule(data=st.data(), key=tokens, keep=st.booleans())
    def match_load_and_lock(self, data, key, keep):
        if self.keys and data.draw(st.booleans()):  # often a key seen before: its KV may be below
            key = data.draw(st.sampled_from(self.keys))
        key = self.aligned(tuple(key))
        want_tree = max((len(p) for p in self.pages(key) if p in self.present), default=0)
        assert self.tree.match_len(list(key)) == want_tree
        reachable = self.tree.reachable_len(list(key))
        match = self.tree.match_prefix(list(key))
        node = match.last_node
        self.tree.lock(node)
        self.locks.append((node, key[:want_tree]))
        need = reachable - len(match)
        if not self.device_free(need):
            self.locks.pop()
            self.tree.unlock(node)
            self.expect_changes(())
            return
        slots = torch.cat([match.indices, self.pool.alloc(need)])
        end, node = self.tree.load_back(list(key), node, slots)
        assert want_tree <= end <= reachable
        values = self.pool.kv[0, 0, slots[:end], 0, 0].tolist()
        assert values == [marker(key[:i + 1]) for i in range(end)], "loaded the wrong KV"
        self.pool.free(slots[end:])
        self.locks[-1] = (node, key[:end])
        self.expect_changes(self.pages(key[:end]))
        if end < len(key) and data.draw(st.booleans()):  # as the engine does: compute the rest, cache it all
            node = self.compute_rest(key, end, node)
        if not keep:
            self.locks.pop()
            self.tree.unlock(node)

    def compute_rest(self, key, end, node):
        """After a load back to `end` (locked at `node`): compute key[end:] in fresh slots and insert
        the whole key; move the lock to its end. (A damaged page missed on the way is written anew.)"""
        if not self.device_free(len(key) - end):
            self.expect_changes(())
            return node
        match = self.tree.match_prefix(list(key[:end]))  # the loaded head, on the device and locked
        fresh = self.pool.alloc(len(key) - end)
        self.write_markers(key, fresh, start=end)
        _, whole = self.tree.insert_prefix(list(key), torch.cat([match.indices, fresh]))
        assert len(whole) == len(key)
        self.pool.free(fresh[fresh != whole.indices[end:]])  # duplicates (none: the tree ended at `end`)
        self.tree.lock(whole.last_node)
        self.tree.unlock(node)
        self.locks[-1] = (whole.last_node, key)
        self.expect_changes(self.pages(key))
        if self.tree.write_policy == "write_through" and self.disk is not None:
            for prefix in self.pages(key):
                if len(prefix) % self.disk.page_tokens == 0:
                    self.assert_on_disk(prefix)
        return whole.last_node

    @rule(data=st.data(), key=tokens)
    def match_only(self, data, key):
        if self.keys and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(self.keys))
        key = self.aligned(tuple(key))
        match = self.tree.match_prefix(list(key))
        on_device = [p for p in self.pages(key) if p in self.present][:len(match) // self.page]
        assert len(match) == len(on_device) * self.page
        assert self.pool.kv[0, 0, match.indices, 0, 0].tolist() == [marker(key[:i + 1]) for i in range(len(match))]
        self.expect_changes(())

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        before = {n.id: (n.last_access, "device" in self.tree.tiers(n)) for n in self.tree.nodes()[1:]}
        evictable = self.tree.evictable_size
        freed = self.tree.evict(num_tokens)
        assert freed == evictable - self.tree.evictable_size
        if freed < num_tokens:
            assert self.tree.evictable_size == 0, "stopped early with evictable tokens left"
        after = {n.id: n for n in self.tree.nodes()[1:]}
        victims = [t for i, (t, dev) in before.items()
                   if dev and (i not in after or "device" not in self.tree.tiers(after[i]))]
        candidates = [n.last_access for n in after.values() if "device" in self.tree.tiers(n) and not n.lock_ref
                      and all("device" not in self.tree.tiers(c) for c in n.children.values())]
        if victims and candidates:
            assert max(victims) <= min(candidates), "device eviction is not least recently used"
        self.expect_changes(())

    @precondition(lambda self: self.disk is not None and self.disk.files())
    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip", "foreign"]))
    def damage_a_disk_file(self, data, how):
        path = data.draw(st.sampled_from(self.disk.files()))
        raw, stamp = path.read_bytes(), path.stat().st_mtime_ns
        if how == "truncate":
            raw = raw[:len(raw) // 2]
        elif how == "flip":
            raw = raw[:-1] + bytes([raw[-1] ^ 0xFF])
        else:
            raw = raw.replace(b'"model": "toy"', b'"model": "yot"')
        path.write_bytes(raw)
        os.utime(path, ns=(stamp, stamp))  # damage is not a use: the LRU order stays
        self.corrupted.add(int(path.stem, 16))

    @precondition(lambda self: self.disk is not None and not self.locks)
    @rule()
    def restart(self):
        """A new process: empty pools and tree, a new store on the warm folder, the same order."""
        order = self.disk.lru_order()
        assert order == sorted(order, key=self.used.__getitem__), "the folder's LRU order is not the reference's"
        self.build(use_disk=True)
        assert self.disk.lru_order() == order

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def structure_and_contents(self):
        if not hasattr(self, "tree"):
            return
        t = self.tree
        t.check_invariants()
        assert self.pool.num_free + t.total_size == self.pool.num_slots, "device slot leak"
        assert t.root.lock_ref == len(self.locks)
        paths = {t.root.id: ()}
        device, host = [], []
        for node in t.nodes()[1:]:
            paths[node.id] = paths[node.parent.id] + node.key
            want = [marker(paths[node.id][:len(paths[node.parent.id]) + i + 1]) for i in range(len(node.key))]
            where = t.tiers(node)
            if "device" in where:
                device += node.value.tolist()
                assert self.pool.kv[0, 0, node.value, 0, 0].tolist() == want, "device KV is wrong"
            if "host" in where:
                slots = node.host_value
                host += slots.tolist()
                assert self.host.kv[0, 0, slots, 0, 0].tolist() == want, "host KV is wrong"
        assert len(set(device)) == len(device) and len(set(host)) == len(host), "a slot held twice"
        for _, prefix in self.locks:
            assert prefix in self.present or not prefix


TieredMachine.TestCase.settings = settings(settings.default, stateful_step_count=25,
                                           max_examples=min(settings.default.max_examples, 300))
TestTieredStateMachine = TieredMachine.TestCase
