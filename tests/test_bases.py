"""The package's parts stand on the bases a learner's do: one class each, whose shared queries give
the package's answers, and whose `insert_prefix` changes the tree in one walk (one clock tick)."""

import random

import pytest
import torch

import kvlearn.parts as parts
from kvlearn import BlockManager, RadixCache
from kvlearn.allocator import PageAllocator
from kvlearn.allocator_base import AllocatorBase
from kvlearn.blocks_base import BlockManagerBase
from kvlearn.radix_base import RadixCacheBase
from kvlearn.workshop.mutants import worked_solutions


def test_the_package_parts_inherit_the_learners_bases():
    assert issubclass(RadixCache, RadixCacheBase) and parts.RadixCacheBase is RadixCacheBase
    assert issubclass(PageAllocator, AllocatorBase) and parts.AllocatorBase is AllocatorBase
    assert issubclass(BlockManager, BlockManagerBase) and parts.BlockManagerBase is BlockManagerBase


class BaseInsertPrefix(RadixCache):
    """RadixCache with the base's `insert_prefix`: an `insert` (RadixCache's walk), then the path
    read back."""

    insert_prefix = RadixCacheBase.insert_prefix

    def insert(self, key, value):
        return RadixCache.insert_prefix(self, key, value)[0]


def state(cache):
    """Every node as the tree holds it (a match stamps the clock's time: equal stamps, equal ticks)."""
    return [(n.id, n.key, n.last_access, n.hits, n.lock_ref, n.value.tolist()) for n in cache.nodes()]


@pytest.mark.parametrize("page_size", [1, 2])
def test_the_bases_queries_give_the_packages_answers(page_size):
    """On random histories: the base's `insert_prefix` returns what RadixCache's one walk does and
    leaves the same tree and clock (one tick); the base's recounted sizes equal the counters."""
    rng = random.Random(page_size)
    freed = {"ours": [], "base": []}
    ours = RadixCache(page_size=page_size, evict_callback=lambda v: freed["ours"].append(v.tolist()))
    base = BaseInsertPrefix(page_size=page_size, evict_callback=lambda v: freed["base"].append(v.tolist()))
    keys, slot = [], 0
    for _ in range(300):
        tail = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 8)))
        key = list(rng.choice(keys)[:rng.randint(0, 9)] + tail if keys and rng.random() < 0.7 else tail)
        if rng.random() < 0.6:
            value = torch.arange(slot, slot + len(key))
            slot += len(key)
            keys.append(tuple(key))
            (n1, m1), (n2, m2) = ours.insert_prefix(key, value), base.insert_prefix(key, value)
            assert (n1, m1.indices.tolist(), m1.last_node.id) == (n2, m2.indices.tolist(), m2.last_node.id)
            if rng.random() < 0.3:
                ours.lock(m1.last_node)
                base.lock(m2.last_node)
        elif rng.random() < 0.5:
            assert ours.match_prefix(key).indices.tolist() == base.match_prefix(key).indices.tolist()
        else:
            n = rng.randint(1, 6)
            assert ours.evict(n) == base.evict(n)
        assert state(ours) == state(base) and freed["ours"] == freed["base"] and ours.clock == base.clock
        assert ours.match_len(key) == base.match_len(key)
        for size in ("evictable_size", "protected_size", "total_size", "num_nodes"):
            assert getattr(RadixCacheBase, size).fget(ours) == getattr(ours, size), size


class NoSplitAtTheEnd(BaseInsertPrefix):
    """An insert that leaves a fully cached key ending inside an edge (it does not walk like
    match_prefix): the base's insert_prefix cannot hand back a node to lock, and says so."""

    def insert(self, key, value):
        if self.match_len(key) == len(key):
            return len(key)
        return super().insert(key, value)


def test_the_bases_insert_prefix_refuses_an_insert_that_does_not_split():
    cache = NoSplitAtTheEnd()
    cache.insert([1, 2, 3], torch.arange(3))
    with pytest.raises(ValueError, match="split the edge where it ends"):
        cache.insert_prefix([1, 2], torch.arange(2))


def test_the_bases_insert_prefix_over_the_worked_solution_ticks_once():
    """Chapter 3's worked solution writes `insert` (one walk, one tick); the base's `insert_prefix`
    reads the path back without a tick, and answers as RadixCache's one walk does."""
    namespace = {}
    exec(worked_solutions()["radix_cache"], namespace)
    mine, ours = namespace["MyRadixCache"](page_size=2), RadixCache(page_size=2)
    for key in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 8], [1, 2], [1, 2, 3, 4], [7, 7]):
        value, before = torch.arange(10, 10 + len(key)), mine.clock
        (n1, m1), (n2, m2) = mine.insert_prefix(key, value), ours.insert_prefix(key, value)
        assert mine.clock == before + 1 == ours.clock
        assert (n1, m1.indices.tolist(), m1.last_node.key) == (n2, m2.indices.tolist(), m2.last_node.key)
        assert [(n.key, n.last_access) for n in mine.nodes()] == [(n.key, n.last_access) for n in ours.nodes()]


def test_the_allocator_bases_recount_gives_the_counters():
    allocator = PageAllocator(6)
    taken = allocator.alloc(4)
    allocator.free(taken[1:3])
    pages = torch.arange(6)
    assert AllocatorBase.num_free.fget(allocator) == allocator.num_free == 4
    assert AllocatorBase.is_free(allocator, pages).tolist() == allocator.is_free(pages).tolist()
    assert repr(allocator) == "PageAllocator(pages=6, free=4)"
