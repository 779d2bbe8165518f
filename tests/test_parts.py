"""Parts: learners' classes inside the engine, and `kvlearn.parts.check` that judges them.

The correct parts below are written the way a learner would, outside the package: they inherit
only the documented bases (the bookkeeping the chapters do not teach), never the finished classes.
The buggy ones inherit the package's classes and break one rule each.
"""

import functools
from collections import Counter
from pathlib import Path

import nbformat
import pytest
import torch

from kvlearn import BlockManager, KVCapacityError, RadixCache, Sequence
from kvlearn.allocator import PageAllocator
from kvlearn.parts import PARTS, AllocatorBase, BlockManagerBase, CheckReport, RadixCacheBase, check
from kvlearn.pool import KVPool
from kvlearn.radix import MatchResult
from kvlearn.serving.cache_modes import make_kv_manager
from kvlearn.serving.config import EngineConfig
from kvlearn.serving.part_registry import served

# --- correct parts, written outside the package ------------------------------------------------

class MyAllocator(AllocatorBase):
    """A Python list as the stack of free pages, its top at the end."""

    def __init__(self, num_pages, device=None):
        super().__init__(num_pages, device)
        self.stack = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self):
        return self.stack[::-1]

    def alloc(self, n):
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        if n > len(self.stack):
            raise KVCapacityError(f"{n} pages asked for, {len(self.stack)} free")
        taken = self.stack[len(self.stack) - n:][::-1]
        del self.stack[len(self.stack) - n:]
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def free(self, pages):
        pages = pages.tolist()
        if len(set(pages)) != len(pages) or set(pages) & set(self.stack) or not all(0 <= p < self.num_pages
                                                                                  for p in pages):
            raise ValueError("double free, or no such page")
        self.stack.extend(pages[::-1])


class MyRadixCache(RadixCacheBase):
    """Chapter 3 by hand: split on match, one leaf per insert, locks up the path, LRU by a scan."""

    def reset(self):
        super().reset()
        self.clock = 0

    def match_prefix(self, key):
        key = self.aligned(self.as_key(key))
        self.clock += 1
        node, i, values = self.root, 0, []
        while i < len(key):
            child = node.children.get(self.child_key(key[i:]))
            if child is None:
                break
            m, p = 0, self.page_size
            while m < len(child.key) and child.key[m:m + p] == key[i + m:i + m + p]:
                m += p
            if m < len(child.key):
                child = self.split(child, m)
            child.last_access = self.clock
            values.append(child.value)
            node, i = child, i + m
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64, device=self.device)
        return MatchResult(indices, node)

    def split(self, child, k):
        upper = self.new_node(child.key[:k], child.value[:k], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self.child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[k:], child.value[k:], upper
        upper.children[self.child_key(child.key)] = child
        return upper

    def insert(self, key, value):
        key = self.as_key(key)
        value = self.as_value(value, len(key))
        key = self.aligned(key)
        match = self.match_prefix(key)
        n = len(match)
        if n < len(key):
            leaf = self.new_node(key[n:], value[n:len(key)].clone(), match.last_node)
            leaf.last_access = self.clock
            match.last_node.children[self.child_key(leaf.key)] = leaf
        return n

    def lock(self, node):
        node.own_locks += 1
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node):
        if node.own_locks == 0:
            raise ValueError("unlock: this node was not locked")
        node.own_locks -= 1
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens):
        freed = 0
        while freed < num_tokens:
            leaves = [n for n in self.nodes()[1:] if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            if self.evict_callback is not None:
                self.evict_callback(victim.value)
            del victim.parent.children[self.child_key(victim.key)]
            victim.parent = None
            freed += len(victim.key)
        return freed


class MyBlockManager(BlockManagerBase):
    """Chapters 1-2 by hand: hash-chain lookup, tables, publish after compute, LRU reuse."""

    def lookup(self, tokens):
        hit, h, size = [], None, self.block_size
        for i in range((len(tokens) - 1) // size if self.enable_prefix_caching else 0):
            block_tokens = tokens[i * size:(i + 1) * size]
            h = self.hash_fn(h, block_tokens)
            b = self.hash_to_block_id.get(h)
            if b is None or self.blocks[b].token_ids != block_tokens:
                break
            hit.append(b)
        return hit

    def num_cached_prefix(self, seq):
        tokens = seq.token_ids if isinstance(seq, Sequence) else list(seq)
        return len(self.lookup(tokens)) * self.block_size

    def needed(self, seq, hit):
        return seq.num_blocks - sum(self.blocks[b].ref_count > 0 for b in hit)

    def can_allocate(self, seq):
        self.check_new(seq)
        return self.needed(seq, self.lookup(seq.token_ids)) <= self.num_free_blocks

    def new_blocks(self, n):
        fresh = min(n, self.allocator.num_free)
        taken = (self.allocator.alloc(fresh).tolist() if fresh else []) + [self.evict_one() for _ in range(n - fresh)]
        for b in taken:
            self.blocks[b].ref_count = 1
        return taken

    def allocate(self, seq):
        self.check_new(seq)
        hit = self.lookup(seq.token_ids)
        if self.needed(seq, hit) > self.num_free_blocks:
            raise KVCapacityError("not enough free blocks")
        for b in hit:
            self.cached_blocks.pop(b, None)
            self.blocks[b].ref_count += 1
        seq.block_table[:] = hit + self.new_blocks(seq.num_blocks - len(hit))
        seq.num_cached_tokens = len(hit) * self.block_size
        self.live_seqs.add(seq.seq_id)
        self.count_hits(seq)

    def hash_blocks(self, seq, num_computed_tokens=None):
        self.check_live(seq)
        n = seq.num_tokens if num_computed_tokens is None else num_computed_tokens
        h, new = None, 0
        for i in range(n // self.block_size if self.enable_prefix_caching else 0):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = self.hash_fn(h, seq.block(i)), seq.block(i)
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
                new += 1
            h = block.hash
        return new

    def can_append(self, seq):
        self.check_live(seq)
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq):
        self.check_live(seq)
        need = seq.num_blocks - len(seq.block_table)
        if need > self.num_free_blocks:
            raise KVCapacityError("not enough free blocks")
        seq.block_table.extend(self.new_blocks(need))

    def deallocate(self, seq):
        self.check_live(seq)
        released = []
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self.hash_to_block_id.get(block.hash) == b:
                    self.cached_blocks[b] = None
                else:
                    self.forget(block)
                    released.append(b)
        if released:
            self.allocator.free(torch.tensor(released[::-1]))   # table order
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        self.live_seqs.discard(seq.seq_id)

    def slot_mapping(self, seq, start, end, device=None):
        self.check_live(seq)
        size = self.block_size
        return torch.tensor([seq.block_table[p // size] * size + p % size for p in range(start, end)],
                            dtype=torch.int64, device=device)


MINE = {"allocator": MyAllocator, "radix_cache": MyRadixCache, "block_manager": MyBlockManager}


# --- known-buggy parts -------------------------------------------------------------------------

class NoOpLocks(RadixCache):
    def lock(self, node):
        pass

    def unlock(self, node):
        pass


class KeepsEverything(BlockManager):
    """deallocate frees nothing: the table goes, the blocks stay held."""

    def deallocate(self, seq):
        self.check_live(seq)
        seq.block_table.clear()
        self.live_seqs.discard(seq.seq_id)


class SlotOffByOne(BlockManager):
    """slot_mapping counts offsets from 1."""

    def slot_mapping(self, seq, start, end, device=None):
        size = self.block_size
        return torch.tensor([seq.block_table[p // size] * size + p % size + 1 for p in range(start, end)])


class NeverAllocates(BlockManager):
    """may_append never gives the table a new block."""

    def may_append(self, seq):
        self.check_live(seq)


class HandsOutTwice(PageAllocator):
    def alloc(self, n):
        pages = super().alloc(n)
        if n >= 2:
            self.free(pages[1:2])   # the second page goes back on the free list while the caller holds it
        return pages


class Empty:
    pass


class LoopsForever(RadixCache):
    def evict(self, num_tokens):
        while True:
            pass


class Raises(BlockManager):
    def allocate(self, seq):
        raise KeyError(seq.seq_id)


class Stub(AllocatorBase):
    def __init__(self, num_pages, device=None):
        super().__init__(num_pages, device)

    @property
    def free_pages(self):
        raise NotImplementedError

    def alloc(self, n):
        raise NotImplementedError

    def free(self, pages):
        raise NotImplementedError


class WrongType(RadixCache):
    def match_prefix(self, key):
        return super().match_prefix(key).indices.tolist()


# --- check ------------------------------------------------------------------------------------

@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@pytest.mark.parametrize("name", sorted(set(PARTS) - {"decode_kernel"}))   # the kernel: test_parts_decode_kernel.py
def test_the_package_parts_pass(name):
    report = check(name, PARTS[name])
    assert report.passed, report.message
    assert report.calls > 1000 and "meets the" in repr(report)


@pytest.mark.parametrize("name", sorted(MINE))
def test_parts_written_outside_the_package_pass(name):
    assert not issubclass(MINE[name], PARTS[name])
    report = check(name, MINE[name])
    assert report.passed, report.message


BUGGY = [
    ("block_table", SlotOffByOne, ["m.slot_mapping(s1,", "expected [", "block_table[p // block_size]"]),
    ("block_table", KeepsEverything, ["m.deallocate(s1)", "ref_count", "expected"]),
    ("block_table", NeverAllocates, ["s1.append_token(", "m.may_append(s1)", "len(s1.block_table): expected",
                                     "may_append gives the sequence a new block"]),
    ("block_table", Empty, ["Not yet", "lacks allocate", "slot_mapping"]),
    ("radix_cache", NoOpLocks, ["cache.unlock(m1.last_node)", "Hint:", "own_locks"]),
    ("block_manager", KeepsEverything, ["m.deallocate(s1)", "ref_count", "expected"]),
    ("allocator", HandsOutTwice, ["alloc(", "expected", "free"]),
    ("radix_cache", Empty, ["Not yet", "match_prefix", "lock"]),
    ("block_manager", Raises, ["KeyError", "m.allocate(s1)"]),
    ("allocator", Stub, ["Not yet", "NotImplementedError"]),
    ("radix_cache", WrongType, ["match_prefix", "must return a MatchResult", "got list"]),
]


@pytest.mark.parametrize("name, impl, words", BUGGY, ids=[f"{b[0]}-{b[1].__name__}" for b in BUGGY])
def test_known_buggy_parts_fail_with_a_message(name, impl, words):
    report = check(name, impl)
    assert isinstance(report, CheckReport) and not report.passed
    for word in words:
        assert word in report.message, report.message
    assert report.message in repr(report) and "FAILED" in repr(report)


def test_block_tables_are_judged_without_prefix_caching():
    """Chapter 1's suite builds the part with caching off and asks nothing of chapter 2."""
    report = check("block_table", KeepsEverything)
    assert "KeepsEverything(" in report.message and "enable_prefix_caching=False" in report.message
    assert check("block_manager", KeepsEverything).message.count("enable_prefix_caching=True") == 1
    lacks = check("block_table", Empty).message.splitlines()[0]
    assert "hash_blocks" not in lacks and "num_cached_prefix" not in lacks and "evict_cached" not in lacks

    lacks = check("block_manager", Empty).message.splitlines()[0]   # chapter 1's members, and chapter 2's
    assert "allocate" in lacks and "slot_mapping" in lacks and "hash_blocks" in lacks and "evict_cached" in lacks


def test_no_op_locks_fail_on_the_sizes():
    class NoOpLocksThatRemember(RadixCache):
        """lock and unlock change no count, but unlock refuses a node that lock never saw."""

        def reset(self):
            super().reset()
            self.seen = Counter()

        def lock(self, node):
            self.seen[node.id] += 1

        def unlock(self, node):
            if not self.seen[node.id]:
                raise ValueError("never locked")
            self.seen[node.id] -= 1

    report = check("radix_cache", NoOpLocksThatRemember)
    assert not report.passed and "protected_size: expected" in report.message, report.message
    assert "lock(node) adds one to lock_ref" in report.message


def test_the_first_failure_is_shrunk_to_a_few_calls():
    report = check("block_manager", KeepsEverything)
    calls = [line for line in report.message.splitlines() if line.startswith("    ")]
    assert len(calls) <= 8, report.message


def test_an_endless_loop_fails_within_the_time_limit():
    report = check("radix_cache", LoopsForever, time_limit_s=1.0)
    assert not report.passed and "did not return within 1 s" in report.message
    assert "cache.evict(" in report.message.splitlines()[-3]


@pytest.mark.parametrize("impl", [None, 3, "RadixCache", lambda **kw: 1 / 0])
def test_check_never_raises_because_of_the_part(impl):
    report = check("radix_cache", impl)
    assert not report.passed and report.message


def test_the_report_is_the_same_every_time():
    assert check("block_manager", KeepsEverything).message == check("block_manager", KeepsEverything).message


def test_an_unknown_part_name_is_the_caller_s_error():
    with pytest.raises(ValueError, match="'block_manager', 'radix_cache', 'allocator'"):
        check("radix", RadixCache)


def test_every_list_of_parts_is_read_from_the_registry():
    """PARTS, SUITES, PART_MODES, BUILD and the table that ends kvlearn.parts' docstring list the
    registry's parts, in its order, with what its records say."""
    import kvlearn.parts
    from kvlearn.exercises.parts import BUILD
    from kvlearn.parts.conformance import SUITES
    from kvlearn.serving.config import PART_MODES
    from kvlearn.serving.part_registry import REGISTRY

    names = [part.name for part in REGISTRY]
    assert len(set(names)) == len(names) and list(PARTS) == list(SUITES) == list(BUILD) == names
    assert list(PART_MODES) == names[1:]   # the block table is checked and drawn, never served
    table = [[cell.strip() for cell in line.split("|")[1:-1]] for line in kvlearn.parts.__doc__.splitlines()
             if line.startswith("| ")][2:]
    assert [row[0] for row in table] == [f'"{name}"' for name in names]
    for part, row in zip(REGISTRY, table, strict=True):
        suite = SUITES[part.name]
        assert suite.record is part and suite.module.__name__ == f"kvlearn.parts.suite_{part.name}"
        assert PARTS[part.name] is suite.package and BUILD[part.name] == (part.chapter, part.exercise)
        assert PART_MODES.get(part.name, ()) == part.modes and part.package is suite.package
        assert row[2:4] == [part.taught, suite.contract.__name__]
    assert [part.taught for part in REGISTRY[:3]] == ["chapter 1", "chapters 1-2", "chapter 3"]


# --- the engine's way in ---------------------------------------------------------------------

def test_engine_config_checks_parts():
    assert EngineConfig(cache="radix", parts={"radix_cache": MyRadixCache}).parts == {"radix_cache": MyRadixCache}
    with pytest.raises(ValueError, match="Unknown part 'radix'.*'block_manager', 'radix_cache', 'allocator'"):
        EngineConfig(parts={"radix": MyRadixCache})
    with pytest.raises(TypeError, match="must be a class.*the parts are"):
        EngineConfig(parts={"allocator": 3})
    with pytest.raises(TypeError, match="dict"):
        EngineConfig(parts=[MyAllocator])
    with pytest.raises(ValueError, match="serves cache='blocks'"):
        EngineConfig(cache="radix", parts={"block_manager": MyBlockManager})
    with pytest.raises(ValueError, match="tiers"):
        EngineConfig(cache="radix", host_slots=64, parts={"radix_cache": MyRadixCache})


@pytest.mark.parametrize("cache, part", [("radix", "radix_cache"), ("blocks", "block_manager")])
def test_the_kv_manager_is_built_from_the_parts(cache, part):
    pool = KVPool(1, 1, 1, 64, page_size=4, allocator_cls=served({"allocator": MyAllocator}, "allocator"))
    kv = served({part: MINE[part]}, part)(pool, 256)
    assert type(kv.cache) is MINE[part] and type(pool.allocator.part) is MyAllocator
    assert isinstance(make_kv_manager(cache, KVPool(1, 1, 1, 64, page_size=4)).cache, PARTS[part])  # missing: ours


@pytest.mark.thorough   # chapter 9 serves the learner's radix cache, block manager and allocator under nbval
@pytest.mark.parametrize("cache", ["radix", "blocks"])
def test_parts_written_outside_the_package_serve_the_real_model(model, tokenizer, cache):
    from kvlearn import Engine
    from kvlearn.serving.workloads import make_workload

    prompts = make_workload("shared_system", tokenizer, num_requests=3).prompt_lists()
    part = "radix_cache" if cache == "radix" else "block_manager"
    mine = {"allocator": MyAllocator, part: MINE[part]}
    theirs = Engine(model, tokenizer, cache=cache, num_slots=1024)
    ours = Engine(model, tokenizer, cache=cache, num_slots=1024, parts=mine)
    assert type(ours.cache) is MINE[part] and type(ours.pool.allocator.part) is MyAllocator
    expected = [out.token_ids for out in theirs.generate(prompts, max_new_tokens=8)]
    assert [out.token_ids for out in ours.generate(prompts, max_new_tokens=8)] == expected
    for key in ("prompt_tokens", "computed_prefill_tokens", "cached_tokens"):
        assert ours.stats[key] == theirs.stats[key], key
    assert ours.stats["cached_tokens"] > 0   # the learner's cache shared the system prompt
    ours.evict_all()
    assert ours.pool.num_free == ours.pool.num_slots


# --- the build exercises of chapters 3 and 4: the notebooks' solutions and the usual wrong turns ---

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


@functools.cache
def notebook_part(notebook: str, name: str) -> dict:
    """The namespace of the instructor solution in the notebook's `%%part NAME` cell, run as the
    magic runs it."""
    cells = [c.source for c in nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
             if c.source.startswith(f"%%part {name}\n")]
    assert len(cells) == 1, f"{notebook}: one %%part {name} cell expected, found {len(cells)}"
    namespace = {}
    exec(compile(cells[0].split("\n", 1)[1], f"{notebook}: %%part {name}", "exec"), namespace)
    return namespace


NOTEBOOK_PARTS = [("03_radix_tree.ipynb", "radix_cache", "MyRadixCache"),
                  ("04_kv_pool.ipynb", "allocator", "MyAllocator")]


@pytest.mark.parametrize("notebook, name, cls", NOTEBOOK_PARTS)
def test_the_notebook_solutions_pass_check(notebook, name, cls):
    impl = notebook_part(notebook, name)[cls]
    assert not issubclass(impl, PARTS[name])
    report = check(name, impl)
    assert report.passed, report.message


def radix_solution():
    return notebook_part("03_radix_tree.ipynb", "radix_cache")["MyRadixCache"]


def allocator_solution():
    return notebook_part("04_kv_pool.ipynb", "allocator")["MyAllocator"]


def split_forgets_lock_ref():
    class SplitForgetsLockRef(radix_solution()):
        def split(self, node, k):
            upper = super().split(node, k)
            upper.lock_ref = 0   # a new node starts unlocked: but the locks below it are below it
            return upper
    return SplitForgetsLockRef


def evicts_locked_leaves():
    class EvictsLockedLeaves(radix_solution()):
        def evict(self, num_tokens):   # the least recently used leaf, locked or not
            freed = 0
            while freed < num_tokens and len(self.nodes()) > 1:
                victim = min((n for n in self.nodes()[1:] if not n.children), key=lambda n: (n.last_access, n.id))
                self.evict_callback(victim.value)
                del victim.parent.children[self.child_key(victim.key)]
                freed += len(victim.key)
            return freed
    return EvictsLockedLeaves


def accepts_a_double_free():
    class AcceptsADoubleFree(allocator_solution()):
        def free(self, pages):   # no flag check: a free page goes on the stack a second time
            if ((pages < 0) | (pages >= self.num_pages)).any():
                raise ValueError("no such page")
            n = min(len(pages), self.num_pages - self.top)
            self.stack[self.top:self.top + n] = pages.flip(0)[:n]
            self.top += n
            self.free_flag[pages] = True
    return AcceptsADoubleFree


def empty_allocator():
    class EmptyAllocator:
        pass
    return EmptyAllocator


WRONG_TURNS = [
    ("radix_cache", split_forgets_lock_ref, ["cache.lock(", "Hint: a split must give the new upper node the lock_ref"]),
    ("radix_cache", evicts_locked_leaves, ["cache.evict(", "it evicted a locked node", "unlocked leaves"]),
    ("allocator", accepts_a_double_free, ["page", "is free", "expected ValueError", "check every page first"]),
    ("allocator", empty_allocator, ["Not yet", "lacks alloc, free, free_pages", "base class"]),
]


@pytest.mark.parametrize("name, make, words", WRONG_TURNS, ids=[w[1].__name__ for w in WRONG_TURNS])
def test_the_guide_s_wrong_turns_fail_with_a_message(name, make, words):
    report = check(name, make())
    assert not report.passed
    for word in words:
        assert word in report.message, report.message


class QueueAllocator(AllocatorBase):
    """vLLM's order: a freed page waits behind every page that was free before it."""

    def __init__(self, num_pages, device=None):
        super().__init__(num_pages, device)
        self.queue = list(range(num_pages))

    @property
    def free_pages(self):
        return list(self.queue)

    def alloc(self, n):
        if n > len(self.queue):
            raise KVCapacityError(f"{n} pages asked for, {len(self.queue)} free")
        taken, self.queue = self.queue[:n], self.queue[n:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, pages):
        pages = pages.tolist()
        if len(set(pages)) != len(pages) or set(pages) & set(self.queue) or not all(0 <= p < self.num_pages
                                                                                  for p in pages):
            raise ValueError("double free, or no such page")
        self.queue += pages


def chapter_4_story(allocator_cls) -> list[list[int]]:
    """Chapter 4's pool story: A takes two pages, B one, A one more, A frees its three, C takes three."""
    pool = KVPool(1, 1, 1, 20, page_size=4, allocator_cls=allocator_cls)
    a = pool.alloc(8)
    b = pool.alloc(4)
    a = torch.cat([a, pool.alloc(4)])
    pool.free(a)
    return [a.tolist(), b.tolist(), pool.alloc(12).tolist()]


def test_a_queue_is_correct_but_fails_check_on_the_stack_order():
    """The contract is chapter 4's stack: a queue (vLLM's order) hands out other slots in the pool
    story (C starts on the page nobody used, 16, instead of A's, freed last), and check names the
    order rule."""
    report = check("allocator", QueueAllocator)
    assert not report.passed
    assert report.message.split("Hint: ")[1].startswith("free(pages) puts the pages back on top of the stack")
    package = chapter_4_story(PageAllocator)
    assert chapter_4_story(allocator_solution()) == package
    queue = chapter_4_story(QueueAllocator)
    assert queue[:2] == package[:2] and queue[2] != package[2] and queue[2][:4] == [16, 17, 18, 19]


def test_the_pictures_read_only_the_contract():
    """RadixTrace, its text, its pictures and the widget on a part whose nodes hold the contract's
    fields and nothing else, and whose evict hands over a copy of each node's slots."""
    from kvlearn.viz import RadixTrace, radix_widget

    class Node:
        __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access",
                     "own_locks")   # the contract's fields, and the one this solution adds

        def __init__(self, node_id, key, value, parent):
            self.id, self.key, self.value, self.parent = node_id, key, value, parent
            self.children, self.lock_ref, self.last_access, self.own_locks = {}, 0, 0, 0

    class ContractOnly(radix_solution()):
        def new_node(self, key, value, parent):
            return Node(next(self._ids), key, value, parent)

        def evict(self, num_tokens):
            callback = self.evict_callback
            self.evict_callback = None if callback is None else (lambda value: callback(value.clone()))
            try:
                return super().evict(num_tokens)
            finally:
                self.evict_callback = callback

    assert check("radix_cache", ContractOnly).passed

    def story(cls):
        trace = RadixTrace(cls())
        trace.insert([1, 2, 3, 4, 5, 6], torch.arange(0, 6))
        trace.insert([1, 2, 3, 7, 8], torch.tensor([0, 1, 2, 6, 7]))
        trace.insert([9, 9, 9], torch.arange(8, 11))
        d = trace.match([1, 2, 3, 4, 5, 6, 10])
        trace.lock(d.last_node)
        trace.evict(4)
        trace.unlock(d.last_node)
        trace.evict(100)
        return trace

    mine, package = story(ContractOnly), story(RadixCache)
    assert [(s.description, s.views, s.marks) for s in mine.steps] == \
        [(s.description, s.views, s.marks) for s in package.steps]
    assert "freed 5 tokens: #3, then #4" in mine.steps[6].description
    assert mine.text(6).splitlines()[2:] == package.text(6).splitlines()[2:]
    assert mine.draw(6).source == package.draw(6).source.replace("RadixCache(", "ContractOnly(")
    radix_widget(mine, step=len(mine) - 1)
