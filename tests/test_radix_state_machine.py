"""RadixCache against a brute-force reference, driven by hypothesis.

The reference (`kvlearn.parts.references.RadixReference`, the one `kvlearn.parts.check` judges
learners' trees by) knows nothing about nodes: it keeps, for every cached page-aligned prefix (a
tuple of tokens), the slots of that prefix's last page, the logical time it was last walked over
and how many matches walked over it (its hits). Under "lru" the victim of every eviction is the
unlocked leaf used least recently; under "lfu" the one with the fewest hits, then the least
recently used. Matching is then "the longest prefix present", inserting is "add the missing
prefixes", and a lock covers every prefix of the locked prefix. The number of examples comes from
the hypothesis profile (150 in `make test`, 1,000 in `make thorough`).
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn.parts.references import RadixReference
from kvlearn.radix import RadixCache

# A 3-token alphabet makes keys share prefixes (and split edges) all the time.
tokens = st.lists(st.integers(0, 2), max_size=12)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 1, 2, 3]), policy=st.sampled_from(["lru", "lru", "lfu"]))
    def setup(self, page_size, policy):
        self.page = page_size
        self.cache = RadixCache(page_size=page_size, evict_callback=self.on_evict, eviction_policy=policy)
        self.ref = RadixReference(page_size, policy)
        self.locks = []      # (node, locked prefix)
        self.keys = []       # keys inserted so far, to build related keys from
        self.next_slot = 0
        self.handed = []     # every slot id given to insert
        self.evicted = []    # slot ids returned through evict_callback
        self.caller_freed = []  # duplicates and unaligned tails the caller frees itself
        self.evict_sizes = []   # token counts of the callbacks of the current evict call

    def on_evict(self, value):
        slots = value.tolist()
        problem = self.ref.evicted(slots)
        assert problem is None, problem
        self.evicted.extend(slots)
        self.evict_sizes.append(len(slots))

    # --- rules -----------------------------------------------------------------------------
    def do_match(self, key):
        key = tuple(key)
        expect = self.ref.cached_length(key)
        before = self.cache.clock, [(n.id, n.key, n.last_access, n.lock_ref) for n in self.cache.nodes()]
        assert self.cache.match_len(list(key)) == expect
        assert (self.cache.clock, [(n.id, n.key, n.last_access, n.lock_ref) for n in self.cache.nodes()]) \
            == before  # a pure query: no split, no tick
        result = self.cache.match_prefix(list(key))
        assert (len(result), result.indices.tolist()) == self.ref.match(key)
        assert result.indices.dtype == torch.int64
        return result, key[:expect]

    def do_insert(self, key):
        key = tuple(key)
        value = torch.arange(self.next_slot, self.next_slot + len(key))
        self.next_slot += len(key)
        self.handed.extend(value.tolist())
        got, inserted = self.cache.insert_prefix(key, value)
        present, slots = self.ref.insert(key, value.tolist())
        assert got == present
        aligned = self.ref.aligned(key)
        assert inserted.indices.tolist() == slots  # the tree's slots, all of them
        assert len(inserted.last_node) > 0 or not aligned
        self.caller_freed.extend(value[:present].tolist() + value[len(aligned):].tolist())
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
        self.ref.lock(prefix)
        self.locks.append((result.last_node, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, prefix = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)
        self.ref.unlock(prefix)

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
        c, ref = self.cache, self.ref
        assert c.total_size == ref.total_size == c.evictable_size + c.protected_size
        assert c.protected_size == ref.protected_size
        assert c.root.lock_ref == len(self.locks)

    @invariant()
    def hits_match_reference(self):
        if not hasattr(self, "cache"):
            return
        for node in self.cache.nodes()[1:]:
            prefix = tuple(t for n in self.path(node) for t in n.key)
            expect = self.ref.hits[prefix]
            assert node.hits == expect, f"node #{node.id}: {node.hits} hits, reference {expect}"

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
            assert self.ref.cached_length(prefix) == len(prefix)

    @invariant()
    def every_slot_accounted_once(self):
        if not hasattr(self, "cache"):
            return
        in_tree = [s for n in self.cache.nodes() for s in n.value.tolist()]
        assert sorted(in_tree) == sorted(s for page in self.ref.slot.values() for s in page)
        assert sorted(in_tree + self.evicted + self.caller_freed) == sorted(self.handed)


RadixMachine.TestCase.settings = settings(settings.default, stateful_step_count=30)
TestRadixStateMachine = RadixMachine.TestCase
