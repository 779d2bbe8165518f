"""RadixCache against a brute-force reference, driven by hypothesis.

The reference knows nothing about nodes: it keeps, for every cached page-aligned prefix (a
tuple of tokens), the slots of that prefix's last page, the logical time it was last walked
over and how many matches walked over it (its hits). Under "lru" the victim of every eviction is
the unlocked leaf used least recently; under "lfu" the one with the fewest hits, then the least
recently used. Matching is then "the longest prefix present", inserting is "add the missing prefixes", and
a lock covers every prefix of the locked prefix. The number of examples comes from the hypothesis profile
(1,000 by default, 10,000 with HYPOTHESIS_PROFILE=thorough).
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn.radix import RadixCache

# A 3-token alphabet makes keys share prefixes (and split edges) all the time.
tokens = st.lists(st.integers(0, 2), max_size=12)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 1, 2, 3]), policy=st.sampled_from(["lru", "lru", "lfu"]))
    def setup(self, page_size, policy):
        self.page, self.policy = page_size, policy
        self.cache = RadixCache(page_size=page_size, evict_callback=self.on_evict, eviction_policy=policy)
        self.slot = {}       # cached page-aligned prefix -> slot ids (tuple) of its last page
        self.time = {}       # cached prefix -> logical time it was last walked over
        self.hits = {}       # cached prefix -> how many match_prefix calls walked over it
        self.clock = 0       # mirrors the cache: one tick per match_prefix / insert
        self.locks = []      # (node, locked prefix)
        self.keys = []       # keys inserted so far, to build related keys from
        self.next_slot = 0
        self.handed = []     # every slot id given to insert
        self.evicted = []    # slot ids returned through evict_callback
        self.caller_freed = []  # duplicates and unaligned tails the caller frees itself
        self.evict_sizes = []   # token counts of the callbacks of the current evict call

    # --- reference helpers -----------------------------------------------------------------
    def aligned(self, key):
        return key[:len(key) // self.page * self.page]

    def cached_length(self, key):
        n = 0
        while n + self.page <= len(key) and key[:n + self.page] in self.slot:
            n += self.page
        return n

    def slots_of(self, key, n):
        return [s for j in range(self.page, n + 1, self.page) for s in self.slot[key[:j]]]

    def touch(self, key, n):
        for j in range(self.page, n + 1, self.page):
            self.time[key[:j]] = self.clock

    def locked(self, prefix):
        return any(lp[:len(prefix)] == prefix for _, lp in self.locks)

    def on_evict(self, value):
        slots = value.tolist()
        victims = [p for p, s in self.slot.items() if s[0] in slots]
        assert sorted(s for p in victims for s in self.slot[p]) == sorted(slots), "callback got unknown slots"
        last = max(victims, key=len)
        parents = {p[:-self.page] for p in self.slot}
        assert last not in parents, "evicted a non-leaf"
        assert not self.locked(last), f"evicted locked prefix {last}"
        # No unlocked leaf goes before the victim: LRU by time, LFU by hits and then time.
        leaves = [p for p in self.slot if p not in parents and not self.locked(p)]
        key = (lambda p: self.time[p]) if self.policy == "lru" else (lambda p: (self.hits[p], self.time[p]))
        assert key(last) <= min(map(key, leaves)), f"eviction does not follow {self.policy}"
        for p in victims:
            del self.slot[p], self.time[p], self.hits[p]
        self.evicted.extend(slots)
        self.evict_sizes.append(len(slots))

    # --- rules -----------------------------------------------------------------------------
    def do_match(self, key):
        key = tuple(key)
        expect = self.cached_length(key)
        before = self.cache._clock, [(n.id, n.key, n.last_access, n.lock_ref) for n in self.cache.nodes()]
        assert self.cache.match_len(list(key)) == expect
        assert (self.cache._clock, [(n.id, n.key, n.last_access, n.lock_ref) for n in self.cache.nodes()]) \
            == before  # a pure query: no split, no tick
        result = self.cache.match_prefix(list(key))
        self.clock += 1
        assert len(result) == expect
        assert result.indices.tolist() == self.slots_of(key, expect)
        assert result.indices.dtype == torch.int64
        self.touch(key, expect)
        for j in range(self.page, expect + 1, self.page):
            self.hits[key[:j]] += 1
        return result, key[:expect]

    def do_insert(self, key):
        key = tuple(key)
        value = torch.arange(self.next_slot, self.next_slot + len(key))
        self.next_slot += len(key)
        self.handed.extend(value.tolist())
        expect = self.cached_length(key)
        got, inserted = self.cache.insert_prefix(key, value)
        self.clock += 1
        assert got == expect
        aligned = self.aligned(key)
        for j in range(expect + self.page, len(aligned) + 1, self.page):
            self.slot[key[:j]] = tuple(value[j - self.page:j].tolist())
            self.hits[key[:j]] = 0
        assert inserted.indices.tolist() == self.slots_of(key, len(aligned))  # the tree's slots, all of them
        assert len(inserted.last_node) > 0 or not aligned
        self.touch(key, len(aligned))
        self.caller_freed.extend(value[:expect].tolist() + value[len(aligned):].tolist())
        self.keys.append(key)

    @rule(key=tokens)
    def insert(self, key):
        self.do_insert(key)

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), tail=tokens)
    def insert_extension(self, data, tail):
        base = data.draw(st.sampled_from(self.keys))
        cut = data.draw(st.integers(0, len(base)))
        self.do_insert(base[:cut] + tuple(tail))

    @rule(key=tokens)
    def match(self, key):
        self.do_match(key)

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), tail=tokens)
    def match_related_and_lock(self, data, tail):
        base = data.draw(st.sampled_from(self.keys))
        result, prefix = self.do_match(base[:data.draw(st.integers(0, len(base)))] + tuple(tail))
        self.cache.lock(result.last_node)
        self.locks.append((result.last_node, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens):
        before = self.cache.evictable_size
        self.evict_sizes = []
        freed = self.cache.evict(num_tokens)
        assert freed == sum(self.evict_sizes) == before - self.cache.evictable_size
        if freed < num_tokens:
            assert self.cache.evictable_size == 0, "stopped early with evictable tokens left"
        if freed:
            assert freed - self.evict_sizes[-1] < num_tokens, "evicted more leaves than needed"

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def sizes_match_reference(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        c = self.cache
        assert c.total_size == self.page * len(self.slot) == c.evictable_size + c.protected_size
        assert c.protected_size == self.page * sum(self.locked(p) for p in self.slot)
        assert c.root.lock_ref == len(self.locks)

    @invariant()
    def hits_match_reference(self):
        if not hasattr(self, "cache"):
            return
        for node in self.cache.nodes()[1:]:
            prefix = tuple(t for n in self.path(node) for t in n.key)
            assert node.hits == self.hits[prefix], f"node #{node.id}: {node.hits} hits, reference {self.hits[prefix]}"

    @staticmethod
    def path(node):
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    @invariant()
    def locked_paths_stay_cached(self):
        if not hasattr(self, "cache"):
            return
        for _, prefix in self.locks:
            assert self.cached_length(prefix) == len(prefix)

    @invariant()
    def every_slot_accounted_once(self):
        if not hasattr(self, "cache"):
            return
        in_tree = [s for n in self.cache.nodes() for s in n.value.tolist()]
        assert sorted(in_tree) == sorted(s for page in self.slot.values() for s in page)
        assert sorted(in_tree + self.evicted + self.caller_freed) == sorted(self.handed)


RadixMachine.TestCase.settings = settings(settings.default, stateful_step_count=30)
TestRadixStateMachine = RadixMachine.TestCase
