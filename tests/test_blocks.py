"""BlockManager: hand-worked scenarios with exact block ids, the runner's tensors, bad input.

Every expected block id below was worked out by hand from three rules: the allocator is a stack
that starts as 0..num_blocks-1 and gets a freed table back head first (its head is reused first);
a new block comes from the allocator while it has one, and only then from the cached blocks,
least recently freed first; deallocate walks a table from its last block to its first, so a cached
prefix's tail is evicted before its head.
"""

import struct

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvlearn import BlockManager, KVCapacityError, Sequence
from kvlearn.blocks import hash_block_tokens
from tests.block_state import snapshot


def seq(ids, block_size=4):
    return Sequence(ids, block_size=block_size)


def prefill(manager, s):
    """allocate + (pretend) forward + publish, as an engine does."""
    manager.allocate(s)
    manager.hash_blocks(s)
    return s


# --- paging without prefix caching (chapter 1) ----------------------------------------------

def test_allocation_and_free_order_without_caching():
    m = BlockManager(6, 4, enable_prefix_caching=False)
    a, b = prefill(m, seq(range(10))), prefill(m, seq(range(5)))
    assert (a.block_table, b.block_table, m.free_block_ids) == ([0, 1, 2], [3, 4], [5])
    m.deallocate(a)
    assert m.free_block_ids == [0, 1, 2, 5]  # A's blocks back on top of the stack, head first
    c = prefill(m, seq(range(10)))
    assert (c.block_table, c.num_cached_tokens) == ([0, 1, 2], 0)  # same tokens, but no caching
    assert m.hash_to_block_id == {} and all(b.hash is None for b in m.blocks)
    assert m.stats.queries == 0


def test_decode_gets_a_new_block_only_at_a_boundary():
    m = BlockManager(4, 4, enable_prefix_caching=False)
    s = prefill(m, seq([1, 2, 3]))
    grew = []
    for t in range(4, 10):  # tokens 4..9 make the sequence 4..9 tokens long
        s.append_token(t)
        assert m.can_append(s)
        m.may_append(s)
        grew.append(len(s.block_table))
    assert grew == [1, 2, 2, 2, 2, 3]  # new blocks when token 5 and token 9 arrive
    assert s.block_table == [0, 1, 2]


# --- prefix caching (chapter 2) ------------------------------------------------------------

def test_sharing_reuse_of_freed_cached_blocks_and_the_full_hit_rule():
    m = BlockManager(8, 4)
    a = prefill(m, seq(range(1, 11)))                      # 10 tokens: 2 full blocks published
    assert (a.block_table, a.num_cached_tokens) == ([0, 1, 2], 0)
    assert [m.blocks[i].token_ids for i in (0, 1)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert m.blocks[2].hash is None                           # partial block: never published

    b = prefill(m, seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52]))
    assert (b.block_table, b.num_cached_tokens) == ([0, 1, 3], 8)
    assert [m.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]

    m.deallocate(a)
    m.deallocate(b)
    assert m.free_block_ids == [3, 2, 4, 5, 6, 7, 1, 0]      # partial blocks 2, 3 back to the allocator
    assert sorted(m.hash_to_block_id.values()) == [0, 1]    # freed published blocks are still cached
    assert (m.num_cached_free_blocks, m.allocator.num_free) == (2, 6)

    c = prefill(m, seq(range(1, 10)))                        # hits the two freed, cached blocks
    assert (c.block_table, c.num_cached_tokens) == ([0, 1, 3], 8)
    assert m.free_block_ids == [2, 4, 5, 6, 7]

    d = prefill(m, seq(range(1, 9)))                         # 8 tokens, all of them cached...
    assert (d.block_table, d.num_cached_tokens) == ([0, 2], 4)  # ...but the last block is recomputed
    assert m.hash_to_block_id[m.blocks[2].hash] == 1           # the duplicate stays unpublished
    assert (m.stats.queries, m.stats.hit_blocks, m.stats.hit_tokens, m.stats.query_tokens) == (4, 5, 20, 38)
    assert m.stats.hit_rate == pytest.approx(20 / 38)


def test_free_pages_first_then_least_recently_freed_cached_blocks_which_lose_their_hash():
    m = BlockManager(4, 2)
    x = prefill(m, seq([1, 2, 3, 4], 2))
    m.deallocate(x)
    assert m.free_block_ids == [2, 3, 1, 0]                    # allocator [2 3], then cached X tail-first
    y = prefill(m, seq([5, 6, 7], 2))
    assert y.block_table == [2, 3]                             # free pages first: X stays cached
    m.deallocate(y)
    assert m.free_block_ids == [3, 1, 0, 2]                    # Y's partial block freed, its [5 6] cached
    z = prefill(m, seq([7, 8, 9, 10, 11], 2))
    assert z.block_table == [3, 1, 0]                          # then X's blocks, freed longest ago
    assert list(m.hash_to_block_id.values()) == [2, 3, 1]      # X's hashes gone; Y's [5 6] stays; Z's
    assert m.blocks[1].token_ids == [9, 10]                    # block 1 now holds Z's second block
    assert m.stats.evicted_blocks == 2
    assert m.num_cached_prefix(seq([1, 2, 3, 4, 5], 2)) == 0
    assert m.num_cached_prefix(seq([5, 6, 0], 2)) == 2


def test_reusing_a_duplicate_block_keeps_the_published_copy():
    # E and F are prefilled in the same step, so F cannot hit E: both compute the same blocks.
    m = BlockManager(6, 2)
    e, f = seq([1, 2, 3, 4, 5], 2), seq([1, 2, 3, 4, 5], 2)
    m.allocate(e)
    m.allocate(f)
    m.hash_blocks(e)
    m.hash_blocks(f)
    assert (e.block_table, f.block_table) == ([0, 1, 2], [3, 4, 5])
    assert sorted(m.hash_to_block_id.values()) == [0, 1]      # first copy wins
    assert m.blocks[4].hash == m.blocks[1].hash
    m.deallocate(f)
    assert (m.free_block_ids, m.num_cached_free_blocks) == ([3, 4, 5], 0)  # duplicates are not cached
    assert m.blocks[4].hash is None
    g = prefill(m, seq([9, 9, 9], 2))
    assert g.block_table == [3, 4]                             # F's duplicate block 4 is reused...
    assert sorted(m.hash_to_block_id.values()) == [0, 1, 3]   # ...without dropping block 1's entry
    assert m.num_cached_prefix(seq([1, 2, 3, 4, 5], 2)) == 4


def test_an_allocated_but_uncomputed_block_is_never_hit():
    m = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5], 2)
    m.allocate(a)
    assert m.num_cached_prefix(seq([1, 2, 3, 4, 5], 2)) == 0
    m.hash_blocks(a, num_computed_tokens=3)                    # chunked prefill: 3 tokens computed
    assert m.num_cached_prefix(seq([1, 2, 3, 4, 5], 2)) == 2
    assert m.hash_blocks(a) == 1                               # the rest; the first is not rehashed
    assert m.num_cached_prefix(seq([1, 2, 3, 4, 5], 2)) == 4


def test_decode_filled_blocks_are_published_and_hit():
    m = BlockManager(8, 4)
    s = prefill(m, seq([1, 2, 3]))
    for t in (4, 5, 6, 7, 8, 9):
        s.append_token(t)
        m.may_append(s)
        m.hash_blocks(s)                                       # after the forward that computed t
    assert s.block_table == [0, 1, 2]
    assert [m.blocks[b].hash is not None for b in s.block_table] == [True, True, False]
    assert m.num_cached_prefix(seq(range(1, 12))) == 8


def test_collision_guard_with_a_weak_hash():
    def weak(parent, tokens):  # ignores the parent and the order of tokens
        return sum(tokens)

    m = BlockManager(6, 2, hash_fn=weak)
    prefill(m, seq([1, 2, 9], 2))
    other = seq([2, 1, 9], 2)                                  # same weak hash, other tokens
    assert m.num_cached_prefix(other) == 0
    prefill(m, other)
    assert other.num_cached_tokens == 0
    assert m.hash_to_block_id == {3: 0}                        # the first owner of hash 3 keeps it


def test_capacity_counts_hits_on_live_blocks_as_free():
    m = BlockManager(4, 2)
    prefill(m, seq([1, 2, 3, 4, 5], 2))                        # blocks 0 1 2, free [3]
    b = seq([1, 2, 3, 4, 7], 2)                                # 3 blocks, 2 shared with live A
    assert m.can_allocate(b)
    m.allocate(b)
    assert (b.block_table, m.num_free_blocks) == ([0, 1, 3], 0)


def test_hits_on_freed_cached_blocks_still_take_a_free_block():
    m = BlockManager(3, 2)
    a = prefill(m, seq([1, 2, 3, 4, 5], 2))
    b = seq([1, 2, 3], 2)
    assert not m.can_allocate(b)                               # the hit is on a live block, 1 more needed
    m.deallocate(a)
    assert m.can_allocate(b)
    m.allocate(b)
    assert (b.block_table, b.num_cached_tokens, m.free_block_ids) == ([0, 2], 2, [1])


def test_num_cached_prefix_changes_nothing():
    m = BlockManager(8, 2)
    a = prefill(m, seq([1, 2, 3, 4, 5], 2))
    m.deallocate(a)
    probe = seq([1, 2, 3, 4, 6], 2)
    before = snapshot(m)
    assert m.num_cached_prefix(probe) == 4
    assert m.can_allocate(probe)
    assert snapshot(m) == before
    m.allocate(probe)
    assert probe.num_cached_tokens == 4


def test_hash_is_stable_and_chained():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == xxhash.xxh64_intdigest(struct.pack("<4q", 1, 2, 3, 4))
    assert h1 == xxhash.xxh64_intdigest(struct.pack("<Q4q", h0, 5, 6, 7, 8))
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1         # same block, other prefix


# --- what the runner consumes ---------------------------------------------------------------

def test_slot_mapping_for_prefill_and_decode():
    m = BlockManager(8, 4)
    prefill(m, seq(range(1, 11)))
    b = prefill(m, seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52]))   # table [0, 1, 3]
    assert m.slot_mapping(b, 8, 11, device="cpu").tolist() == [12, 13, 14]  # the uncached part of the prefill
    b.append_token(53)
    b.append_token(54)                                          # position 12 needs a new block
    m.may_append(b)
    assert b.block_table == [0, 1, 3, 4]
    slots = m.slot_mapping(b, 12, 13)
    assert slots.tolist() == [16] and slots.dtype == torch.int64 and slots.shape == (1,)


@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(1, 5))
def test_slot_mapping_matches_the_formula(lengths, block_size):
    m = BlockManager(4 * 30, block_size, enable_prefix_caching=False)
    seqs = [prefill(m, Sequence([7] * n, block_size=block_size)) for n in lengths]
    for s in seqs:
        expected = [s.block_table[p // block_size] * block_size + p % block_size for p in range(s.num_tokens)]
        assert m.slot_mapping(s, 0, s.num_tokens).tolist() == expected
    used = torch.cat([m.slot_mapping(s, 0, s.num_tokens) for s in seqs])
    assert len(set(used.tolist())) == len(used)                 # no two tokens share a slot


def test_block_tables_padded_with_minus_one():
    m = BlockManager(8, 2)
    a, b = prefill(m, seq([1, 2, 3, 4, 5], 2)), prefill(m, seq([8, 9], 2))
    t = m.block_tables([a, b])
    assert t.tolist() == [[0, 1, 2], [3, -1, -1]] and t.dtype == torch.int64
    assert m.block_tables([]).shape == (0, 0)
    assert m.block_tables([b], device="cpu").tolist() == [[3]]


# --- bad input: a clear error, and nothing changed --------------------------------------------

@pytest.mark.parametrize("args, error", [
    ((0, 4), ValueError), ((4, 0), ValueError), ((-1, 4), ValueError), ((4, -2), ValueError),
    ((4.0, 4), TypeError), ((4, "4"), TypeError), ((4, 4, True, 5), TypeError),
])
def test_bad_constructor_arguments(args, error):
    with pytest.raises(error):
        BlockManager(*args)


def _live_setup():
    m = BlockManager(4, 2)
    a = prefill(m, seq([1, 2, 3, 4, 5], 2))
    return m, a


@pytest.mark.parametrize("call, error, words", [
    (lambda m, a: m.allocate(a), ValueError, "already has a block table"),
    (lambda m, a: m.can_allocate(a), ValueError, "already has a block table"),
    (lambda m, a: m.allocate(seq([1, 2, 3], 4)), ValueError, "block_size"),
    (lambda m, a: m.allocate([1, 2, 3]), TypeError, "Sequence"),
    (lambda m, a: m.allocate(seq([7] * 5, 2)), KVCapacityError, "needs 3 free blocks but only 1"),
    (lambda m, a: m.allocate(seq([7] * 9, 2)), KVCapacityError, "never fit"),
    (lambda m, a: m.deallocate(seq([1, 2], 2)), ValueError, "not allocated"),
    (lambda m, a: m.may_append(seq([1, 2], 2)), ValueError, "not allocated"),
    (lambda m, a: m.can_append(seq([1, 2], 2)), ValueError, "not allocated"),
    (lambda m, a: m.hash_blocks(seq([1, 2], 2)), ValueError, "not allocated"),
    (lambda m, a: m.hash_blocks(a, 7), ValueError, "outside 0..5"),
    (lambda m, a: m.hash_blocks(a, -1), ValueError, "num_computed_tokens"),
    (lambda m, a: m.hash_blocks(a, 2.0), TypeError, "int"),
    (lambda m, a: m.slot_mapping(a, 3, 2), ValueError, "start <= end"),
    (lambda m, a: m.slot_mapping(a, 0, 6), ValueError, "start <= end"),
    (lambda m, a: m.slot_mapping(a, 0, 1.5), TypeError, "end"),
    (lambda m, a: m.block_tables([a, seq([1], 2)]), ValueError, "not allocated"),
    (lambda m, a: m.num_cached_prefix(seq([1], 3)), ValueError, "block_size"),
])
def test_bad_calls_change_nothing(call, error, words):
    m, a = _live_setup()
    before = snapshot(m, [a])
    with pytest.raises(error, match=words):
        call(m, a)
    assert snapshot(m, [a]) == before


def test_deallocating_twice_is_an_error_that_changes_nothing():
    m, a = _live_setup()
    m.deallocate(a)
    before = snapshot(m, [a])
    with pytest.raises(ValueError, match="already deallocated"):
        m.deallocate(a)
    assert snapshot(m, [a]) == before


def test_may_append_without_a_free_block_changes_nothing():
    m = BlockManager(2, 2)
    a = prefill(m, seq([1, 2, 3, 4], 2))
    a.append_token(5)                                          # would need a third block
    before = snapshot(m, [a])
    assert not m.can_append(a)
    with pytest.raises(KVCapacityError, match="preempt"):
        m.may_append(a)
    assert snapshot(m, [a]) == before
    with pytest.raises(ValueError, match="may_append"):        # token 5 has no slot yet
        m.slot_mapping(a, 4, 5)


def test_repr_is_readable():
    m, a = _live_setup()
    assert repr(m) == "BlockManager(num_blocks=4, block_size=2, free=1 (0 still cached), hashed=2, live_seqs=1)"
    assert repr(m.blocks[2]) == "Block(block_id=2, ref_count=1, hash=-, tokens=[])"
    assert repr(m.blocks[0]).startswith("Block(block_id=0, ref_count=1, hash=")


def test_evict_cached_forgets_only_prefixes_held_by_free_blocks():
    manager = BlockManager(num_blocks=6, block_size=4)
    done, live = Sequence(list(range(9)), block_size=4), Sequence(list(range(100, 109)), block_size=4)
    for seq in (done, live):
        manager.allocate(seq)
        manager.hash_blocks(seq)
    manager.deallocate(done)  # its two full blocks stay published, now free
    assert manager.num_cached_free_blocks == 2 and len(manager.hash_to_block_id) == 4
    assert manager.evict_cached() == 8
    assert manager.num_cached_free_blocks == 0 and len(manager.hash_to_block_id) == 2  # live's blocks kept
    assert manager.num_cached_prefix(Sequence(list(range(9)), block_size=4)) == 0
    assert manager.num_cached_prefix(Sequence(list(range(100, 109)), block_size=4)) == 8
    assert manager.evict_cached() == 0


def test_collision_guard_also_checks_the_parent():
    """With a weak hash that ignores the parent, equal tokens after a different prefix must miss."""
    manager = BlockManager(num_blocks=8, block_size=4, hash_fn=lambda parent, tokens: sum(tokens))

    def prefill(ids):
        seq = Sequence(ids, block_size=4)
        manager.allocate(seq)
        manager.hash_blocks(seq)

    prefill([20, 0, 0, 0, 99])                  # [20 0 0 0] published under 20
    prefill([1, 2, 3, 4, 5, 6, 7, 8, 99])       # [5 6 7 8] computed after [1 2 3 4]
    seq = Sequence([20, 0, 0, 0, 5, 6, 7, 8, 99], block_size=4)
    assert manager.num_cached_prefix(seq) == 4  # block 0 hits; block 1's KV belongs to another prefix
