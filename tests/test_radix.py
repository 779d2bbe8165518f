"""Hand-worked RadixCache scenarios: every expected value below was worked out on paper."""

import statistics
import time

import pytest
import torch

from kvlearn import MatchResult, RadixCache, TreeNode


def slots(*ids):
    return torch.tensor(ids, dtype=torch.int64)


def shape(cache):
    """The tree as (key, slots, lock_ref) per node, depth first: compares structure, not ids."""
    return [(n.key, n.value.tolist(), n.lock_ref) for n in cache.nodes()]


def state(cache):
    """Everything observable, to check that a rejected call changed nothing."""
    return (shape(cache), [(n.id, n.last_access) for n in cache.nodes()], cache.clock,
            cache.eviction_heap, cache.evictable_size, cache.protected_size)


def recorder():
    freed = []
    return freed, RadixCache(evict_callback=lambda v: freed.append(v.tolist()))


def test_split_in_the_middle_of_an_edge():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5, 6], slots(10, 11, 12, 13, 14, 15)) == 0
    result = cache.match_prefix([1, 2, 3, 9])
    assert isinstance(result, MatchResult) and len(result) == 3
    assert result.indices.tolist() == [10, 11, 12]
    assert result.last_node.key == (1, 2, 3)  # the split made a node that ends exactly at the match
    assert shape(cache) == [((), [], 0), ((1, 2, 3), [10, 11, 12], 0), ((4, 5, 6), [13, 14, 15], 0)]
    assert cache.total_size == 6
    cache.check_invariants()


def test_match_after_split_walks_both_halves():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], slots(10, 11, 12, 13, 14, 15))
    cache.match_prefix([1, 2])
    full = cache.match_prefix(torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    assert full.indices.tolist() == [10, 11, 12, 13, 14, 15]
    assert full.last_node.key == (3, 4, 5, 6)
    assert cache.match_prefix([2, 1]).last_node is cache.root
    assert len(cache.match_prefix([])) == 0


def test_insert_of_an_existing_key_returns_its_full_length_and_keeps_old_slots():
    cache = RadixCache()
    cache.insert([5, 6, 7], slots(0, 1, 2))
    before = shape(cache)
    assert cache.insert([5, 6, 7], slots(7, 8, 9)) == 3
    assert shape(cache) == before
    assert cache.insert([5, 6], slots(3, 4)) == 2  # a prefix of an edge is already present too
    assert cache.match_prefix([5, 6, 7]).indices.tolist() == [0, 1, 2]


def test_insert_returns_the_shared_prefix_and_stores_only_the_rest():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    assert cache.insert([1, 2, 8, 9], slots(5, 6, 7, 8)) == 2
    assert shape(cache) == [((), [], 0), ((1, 2), [0, 1], 0), ((3,), [2], 0), ((8, 9), [7, 8], 0)]
    assert cache.total_size == 5


def test_insert_keeps_its_own_copy_of_the_slots():
    cache = RadixCache()
    value = slots(0, 1, 2)
    cache.insert([1, 2, 3], value)
    value.fill_(99)  # the caller reuses its buffer (like a req_to_token row)
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [0, 1, 2]


def test_page_aligned_insert_and_match():
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5], slots(0, 1, 2, 3, 4)) == 0
    assert cache.total_size == 4  # the half page (5) is not stored
    assert cache.match_prefix([1, 2, 3, 9]).indices.tolist() == [0, 1]
    assert len(cache.match_prefix([1])) == 0  # less than a page never matches
    assert len(cache.match_prefix([1, 2, 3, 4, 5])) == 4
    # [1,2,3,5] shares 3 tokens but only one whole page: its second page is a new child.
    assert cache.insert([1, 2, 3, 5], slots(6, 7, 8, 9)) == 2
    assert shape(cache) == [((), [], 0), ((1, 2), [0, 1], 0), ((3, 4), [2, 3], 0), ((3, 5), [8, 9], 0)]
    assert sorted(cache.nodes()[1].children) == [(3, 4), (3, 5)]  # children keyed by first page
    cache.check_invariants()


def test_page_aligned_split_lands_on_a_page_boundary():
    cache = RadixCache(page_size=3)
    cache.insert(list(range(9)), torch.arange(9))
    result = cache.match_prefix([0, 1, 2, 3, 4, 99, 6, 7, 8])  # mismatch in the second page
    assert len(result) == 3 and result.last_node.key == (0, 1, 2)
    assert [n.key for n in cache.nodes()] == [(), (0, 1, 2), (3, 4, 5, 6, 7, 8)]


def test_eviction_order_is_least_recently_used():
    freed, cache = recorder()
    cache.insert([1, 1], slots(0, 1))    # A, t=1
    cache.insert([2, 2], slots(2, 3))    # B, t=2
    cache.insert([3, 3], slots(4, 5))    # C, t=3
    cache.match_prefix([1, 1])           # A is now the most recent
    assert cache.evict(1) == 2 and freed == [[2, 3]]  # one whole leaf even if 1 token was asked
    assert cache.evict(2) == 2 and freed[-1] == [4, 5]
    assert cache.evict(2) == 2 and freed[-1] == [0, 1]
    assert cache.evict(5) == 0 and cache.total_size == 0


def test_parent_becomes_a_candidate_when_its_last_child_goes():
    freed, cache = recorder()
    cache.insert([1, 2, 3], slots(0, 1, 2))   # t=1
    cache.insert([1, 2, 4], slots(9, 9, 3))   # t=2: shares [1,2], adds leaf (4,)
    cache.insert([7], slots(4))               # t=3, a newer leaf
    # leaves by age: (3,) t=1, (4,) t=2, (7,) t=3; after both go, (1,2) (t=2) beats (7,) (t=3).
    assert cache.evict(4) == 4
    assert freed == [[2], [3], [0, 1]]
    assert shape(cache) == [((), [], 0), ((7,), [4], 0)]
    cache.check_invariants()


def test_callback_receives_exactly_the_freed_slots():
    freed, cache = recorder()
    for i in range(5):
        cache.insert([i] * (i + 1), torch.arange(10 * i, 10 * i + i + 1))
    total = cache.total_size
    assert cache.evict(total) == total
    assert sorted(s for v in freed for s in v) == sorted(s for i in range(5) for s in range(10 * i, 10 * i + i + 1))
    assert (cache.total_size, cache.evictable_size, cache.num_nodes) == (0, 0, 1)


def test_lock_protects_the_path_and_unlock_releases_it():
    freed, cache = recorder()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    cache.insert([1, 2, 9], slots(0, 1, 4))
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    assert cache.evict(100) == 1 and freed == [[4]]  # only the unlocked branch goes
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == [0, 1, 2, 3]
    cache.lock(node)
    cache.unlock(node)
    assert cache.protected_size == 4  # still held once
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size, cache.root.lock_ref) == (0, 4, 0)
    assert cache.evict(100) == 4


def test_insert_under_a_locked_path_keeps_sizes_right():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    held = cache.match_prefix([1, 2, 3]).last_node
    cache.lock(held)
    assert cache.insert([1, 2, 3, 4, 5], slots(0, 1, 2, 3, 4)) == 3  # extends the locked leaf
    assert (cache.protected_size, cache.evictable_size) == (3, 2)
    assert cache.insert([1, 9], slots(0, 5)) == 1  # splits the locked edge: both halves stay locked
    assert (cache.protected_size, cache.evictable_size) == (3, 3)
    upper = cache.match_prefix([1]).last_node
    assert upper.key == (1,) and upper.lock_ref == 1 and held.key == (2, 3)
    cache.check_invariants()
    # The engine's re-lock after insert: lock the longer path, then release the old one.
    new = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    cache.lock(new)
    cache.unlock(held)
    assert (cache.protected_size, cache.evictable_size) == (5, 1)
    cache.check_invariants()


def test_lock_and_unlock_of_the_root_count_on_the_root():
    cache = RadixCache()
    result = cache.match_prefix([1, 2])
    assert result.last_node is cache.root
    cache.lock(result.last_node)
    assert cache.root.lock_ref == 1 and cache.protected_size == 0
    cache.unlock(result.last_node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.root)


def test_same_calls_give_the_same_tree():
    def build():
        cache = RadixCache()
        for i, key in enumerate([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6], [7]]):
            cache.insert(key, torch.arange(len(key)) + 10 * i)
            cache.match_prefix(key[:2])
        cache.evict(2)
        return [(n.id, n.key, n.last_access, n.value.tolist()) for n in cache.nodes()]

    assert build() == build()


def test_reset_empties_the_tree():
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 1))
    cache.lock(cache.match_prefix([1, 2]).last_node)
    cache.reset()
    assert (cache.total_size, cache.num_nodes, len(cache.match_prefix([1, 2]))) == (0, 1, 0)
    cache.check_invariants()


def test_repr_is_readable():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    assert repr(cache) == "RadixCache(page_size=2, nodes=2, total=4, evictable=4, protected=0)"
    result = cache.match_prefix([1, 2])
    assert repr(result) == f"MatchResult(len=2, last_node=#{result.last_node.id})"
    assert repr(result.last_node).startswith(f"TreeNode(id={result.last_node.id}, tokens=2,")


def test_heap_of_stale_entries_stays_bounded():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    for _ in range(5000):
        cache.match_prefix([1, 2, 3])  # each touch pushes a new entry for the leaf
    assert len(cache.eviction_heap) <= 2 * cache.num_nodes + 65
    cache.check_invariants()


# --- bad input: a clear error and no change --------------------------------------------------

def filled():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 4], slots(0, 3))
    return cache


@pytest.mark.parametrize("call, error, words", [
    (lambda c, leaf: c.insert([1, 2, 3], slots(0, 1)), ValueError, "one slot per token"),
    (lambda c, leaf: c.insert([1, 2], [0, 1]), TypeError, "value must be"),
    (lambda c, leaf: c.insert([1, 2], torch.tensor([0.0, 1.0])), TypeError, "integer"),
    (lambda c, leaf: c.insert([1, 2], torch.zeros(2, 1, dtype=torch.int64)), TypeError, "1-D"),
    (lambda c, leaf: c.insert([1, 2.5], slots(0, 1)), TypeError, "Python ints"),
    (lambda c, leaf: c.insert(["a"], slots(0)), TypeError, "Python ints"),
    (lambda c, leaf: c.insert([1, -2], slots(0, 1)), ValueError, "negative"),
    (lambda c, leaf: c.match_prefix([1.0]), TypeError, "Python ints"),
    (lambda c, leaf: c.match_prefix(torch.tensor([1.0])), TypeError, "integer dtype"),
    (lambda c, leaf: c.match_prefix("abc"), TypeError, "list/tuple"),
    (lambda c, leaf: c.match_prefix([True]), TypeError, "Python ints"),
    (lambda c, leaf: c.evict(-1), ValueError, ">= 0"),
    (lambda c, leaf: c.evict(1.5), TypeError, "int"),
    (lambda c, leaf: c.unlock(leaf), ValueError, "not locked"),
    (lambda c, leaf: c.lock("node"), TypeError, "TreeNode"),
    (lambda c, leaf: c.lock(filled().nodes()[-1]), ValueError, "not in this tree"),
])
def test_bad_input_raises_and_changes_nothing(call, error, words):
    cache = filled()
    leaf = cache.nodes()[-1]  # an unlocked leaf, taken without touching the tree
    assert isinstance(leaf, TreeNode) and leaf.lock_ref == 0
    before = state(cache)
    with pytest.raises(error, match=words):
        call(cache, leaf)
    assert state(cache) == before


def test_unlock_takes_only_a_node_that_was_locked_itself():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    head = cache.match_prefix([1, 2]).last_node          # splits [1 2 3 4] into [1 2] + [3 4]
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.lock(leaf)
    before = state(cache)
    with pytest.raises(ValueError, match="not locked itself.*counts locks on nodes below"):
        cache.unlock(head)                               # locked only through its child
    assert state(cache) == before
    upper = cache.match_prefix([1, 2, 3]).last_node      # splits the locked leaf: [3] + [4]
    assert (upper.lock_ref, upper.own_locks, leaf.key, leaf.own_locks) == (1, 0, (4,), 1)
    with pytest.raises(ValueError, match="not locked itself"):
        cache.unlock(upper)
    cache.unlock(leaf)                                   # the object that was locked keeps its lock
    cache.check_invariants()
    assert (cache.protected_size, cache.evictable_size) == (0, 4)


def test_insert_prefix_returns_what_to_lock_without_a_second_walk():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    clock = cache.clock
    present, match = cache.insert_prefix([1, 2, 3, 4, 5], slots(20, 21, 22, 23, 24))
    assert (present, match.indices.tolist(), match.last_node.key) == (3, [10, 11, 12, 23, 24], (4, 5))
    assert cache.clock == clock + 1 and cache.match_len([1, 2, 3, 4, 5, 6]) == 5


def test_locking_an_evicted_node_is_refused():
    cache = filled()
    node = cache.match_prefix([1, 4]).last_node
    cache.evict(100)
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(node)
    assert node.parent is None and cache.total_size == 0


@pytest.mark.parametrize("page_size, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_page_size(page_size, error):
    with pytest.raises(error, match="page_size"):
        RadixCache(page_size=page_size)


def test_bad_callback():
    with pytest.raises(TypeError, match="callable"):
        RadixCache(evict_callback=3)


# --- scale: cost follows the matched length, not the tree size -------------------------------

def median_match_us(cache, probe, reps=300):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        cache.match_prefix(probe)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def test_match_and_evict_cost_do_not_grow_with_the_tree():
    from kvlearn.bench.radix import make_trace, slot_values

    keys = make_trace(2000)
    values = slot_values(keys)
    small, big = RadixCache(), RadixCache()
    for key, value in zip(keys[:20], values[:20], strict=True):
        small.insert(key, value)
    for key, value in zip(keys, values, strict=True):
        big.insert(key, value)
    assert big.total_size > 50 * small.total_size
    probe = keys[0][:80] + [49151] * 100
    # An O(tree) walk would be ~50x slower on the big tree; allow noise from a shared machine.
    assert median_match_us(big, probe) < 5 * median_match_us(small, probe)
    start = time.perf_counter()
    for _ in range(100):
        small.evict(1)
    t_small = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        big.evict(1)
    assert time.perf_counter() - start < 5 * t_small + 0.01


# --- eviction policies ----------------------------------------------------------------------

def random_history(cache, seed, steps=400):
    """Seeded inserts, matches, locks, unlocks and evictions; returns the evicted slot lists in order."""
    import random

    rng, evicted, locked, next_slot = random.Random(seed), [], [], 0
    cache.evict_callback = lambda value: evicted.append(value.tolist())
    for _ in range(steps):
        key, r = [rng.randrange(3) for _ in range(rng.randint(1, 8))], rng.random()
        if r < 0.35:
            cache.insert(key, torch.arange(next_slot, next_slot + len(key)))
            next_slot += len(key)
        elif r < 0.7:
            m = cache.match_prefix(key)
            if rng.random() < 0.3:
                cache.lock(m.last_node)
                locked.append(m.last_node)
        elif r < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randint(1, 10))
    cache.check_invariants()
    return evicted


def test_the_default_policy_is_lru_and_named_or_as_a_key_it_evicts_the_same():
    for seed in range(5):
        default = random_history(RadixCache(), seed)
        assert default == random_history(RadixCache(eviction_policy="lru"), seed)
        assert default == random_history(RadixCache(eviction_policy=lambda node: node.last_access), seed)
    assert RadixCache().eviction_policy == "lru" and RadixCache(eviction_policy="lfu").eviction_policy == "lfu"
    assert "eviction_policy" not in repr(RadixCache()) and repr(RadixCache(eviction_policy="lfu")).endswith(
        "protected=0, eviction_policy=lfu)")


def test_hits_count_the_matches_that_walked_through_a_node():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    assert leaf.hits == 1                          # insert counts no hit, a match does
    cache.match_len([1, 2, 3, 4])                  # a pure query counts none
    upper = cache.match_prefix([1, 2, 9]).last_node  # splits [1 2 3 4]: the upper half inherits the hit
    assert (upper.key, upper.hits, leaf.key, leaf.hits) == ((1, 2), 2, (3, 4), 1)
    cache.insert([1, 2, 3, 4, 5], slots(0, 1, 2, 3, 4))
    assert (upper.hits, leaf.hits) == (2, 1)
    assert cache.match_prefix([1, 2, 3, 4, 5]).last_node.hits == 1 and leaf.hits == 2


def test_lfu_evicts_the_least_hit_leaf_and_lru_among_equals():
    freed = {}
    for policy in ("lru", "lfu"):
        out = freed[policy] = []
        cache = RadixCache(eviction_policy=policy, evict_callback=lambda v, out=out: out.append(v.tolist()))
        cache.insert([1, 1], slots(0, 1))       # A
        cache.insert([2, 2], slots(2, 3))       # B
        cache.insert([3, 3], slots(4, 5))       # C
        for _ in range(3):
            cache.match_prefix([1, 1])          # A: 3 hits, long ago
        cache.match_prefix([3, 3])              # C: 1 hit, most recent
        cache.evict(6)
    assert freed["lru"] == [[2, 3], [0, 1], [4, 5]]  # B, A, C: by last use
    assert freed["lfu"] == [[2, 3], [4, 5], [0, 1]]  # B (0 hits), C (1), A (3)


def test_a_key_that_decreases_when_touched_still_evicts_in_order():
    """The heap keeps stale entries and skips them at pop time; every touch pushes the current key,
    so even a key that shrinks when a node is used (most recently used first) is evicted in order."""
    victims = []
    cache = RadixCache(eviction_policy=lambda node: -node.last_access)

    def record(value):
        leaves = [n for n in cache.nodes()[1:] if not n.children and not n.lock_ref]
        victims.append((max(n.last_access for n in leaves), next(n.last_access for n in leaves
                                                                 if n.value.tolist() == value.tolist())))

    for seed in range(5):
        cache.reset()
        random_history(cache, seed)
        cache.evict_callback = record
        cache.evict(cache.evictable_size)
    assert victims and all(newest == taken for newest, taken in victims)


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="choose one of 'lru', 'lfu'"):
        RadixCache(eviction_policy="LFU")
    with pytest.raises(TypeError, match="a function node -> key"):
        RadixCache(eviction_policy=3)


# --- chapter 3 exercise checkers: a right answer passes, a wrong one does not ----------------

def relock_solution(cache, key, value, old_node):
    duplicates, match = cache.insert_prefix(key, value)
    cache.lock(match.last_node)
    cache.unlock(old_node)
    return match.last_node, duplicates


def relock_unlock_first(cache, key, value, old_node):
    """SGLang's order: right in a single-threaded engine, wrong if an eviction can run in between."""
    duplicates, match = cache.insert_prefix(key, value)
    cache.unlock(old_node)
    cache.lock(match.last_node)
    return match.last_node, duplicates


def test_exercise_checkers_accept_right_answers(capsys):
    from kvlearn.exercises import ch03

    assert ch03.check_relock(relock_solution)
    assert capsys.readouterr().out.count("OK") == 1


def test_exercise_checkers_reject_wrong_answers(capsys):
    from kvlearn.exercises import ch03

    def forgets_to_lock(cache, key, value, old_node):
        duplicates = cache.insert(key, value)
        cache.unlock(old_node)
        return cache.match_prefix(key).last_node, duplicates

    assert not ch03.check_relock(forgets_to_lock)
    assert not ch03.check_relock(relock_unlock_first)
    out = capsys.readouterr().out
    assert out.count("Not yet") == 2 and "Which of lock and unlock must come first" in out


def test_unlock_first_is_safe_when_nothing_evicts_in_between(capsys):
    from kvlearn.exercises.ch03 import _relock_problems

    assert _relock_problems(relock_unlock_first, RadixCache) == []
    assert _relock_problems(relock_solution, RadixCache) == []


def test_a_raising_evict_callback_strands_nothing():
    calls = []

    def callback(value):
        calls.append(value)
        if len(calls) == 1:
            raise RuntimeError("pool refused")

    cache = RadixCache(evict_callback=callback)
    cache.insert([1, 2], torch.tensor([0, 1]))
    cache.insert([1, 2, 3], torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="pool refused"):
        cache.evict(1)
    cache.check_invariants()  # the slots were not taken back, so the node is still cached
    assert cache.total_size == 3 and cache.evict(10) == 3 and cache.total_size == 0
    assert [v.tolist() for v in calls] == [[2], [2], [0, 1]]


def test_lfu_exercise_checkers(capsys):
    from kvlearn.exercises import ch03

    def disagree(cache):   # X is hit more, Y is used last
        cache.insert([1, 2], torch.tensor([0, 1]))
        cache.insert([3, 4], torch.tensor([2, 3]))
        for key in ([1, 2], [1, 2], [3, 4]):
            cache.match_prefix(key)

    def agree(cache):      # X is hit more and used last: both policies take Y
        cache.insert([1, 2], torch.tensor([0, 1]))
        cache.insert([3, 4], torch.tensor([2, 3]))
        for key in ([3, 4], [1, 2], [1, 2]):
            cache.match_prefix(key)

    def evicts_itself(cache):   # what the history evicts itself does not count
        disagree(cache)
        cache.evict(100)

    assert ch03.check_policies_disagree(disagree)
    for wrong in (agree, lambda cache: None, lambda cache: 1 / 0, evicts_itself):
        assert not ch03.check_policies_disagree(wrong)
    out = capsys.readouterr().out
    assert out.count("OK") == 1 and out.count("Not yet") == 4
    assert "both policies evict the leaf with slots [2, 3] first" in out and "more hits" in out
    assert "evict(1) takes nothing" in out and "ZeroDivisionError" in out

    trace = ch03.chat_trace()
    longest = max(len(prompt) + len(answer) for prompt, answer in trace)
    pools = [longest, 2 * longest]
    lru = {n: ch03.reference_hit_rate(trace, n, "lru") for n in pools}
    lfu = {n: ch03.reference_hit_rate(trace, n, "lfu") for n in pools}
    assert all(lfu[n] < lru[n] for n in pools) and lru[2 * longest] - lfu[2 * longest] > 0.2  # the lesson holds
    assert ch03.check_lfu_measured(lru, lfu, "b")
    assert not ch03.check_lfu_measured(lru, lfu, "a")
    assert not ch03.check_lfu_measured(lru, lru, "b")          # LRU's numbers twice
    assert not ch03.check_lfu_measured(..., ..., ...)          # the stubs
    assert not ch03.check_lfu_measured({}, {}, "b")
    out = capsys.readouterr().out
    assert out.count("OK") == 1 and out.count("Not yet") == 4 and out.count("pool slots") == 2


def test_the_chat_trace_is_multi_turn_and_fixed():
    from kvlearn.exercises import ch03

    trace = ch03.chat_trace()
    assert trace == ch03.chat_trace() and len(trace) == 167
    system = trace[0][0][:40]
    assert all(prompt[:40] == system for prompt, _ in trace)
    follow_ups = [i for i, (prompt, _) in enumerate(trace)
                  if any(prompt[:len(p) + len(a)] == p + a for p, a in trace[:i])]
    assert len(follow_ups) == 127  # every other prompt resends an earlier turn and its answer
