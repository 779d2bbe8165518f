"""BlockManager against a brute-force reference, driven by hypothesis.

The reference (`kvlearn.parts.references.BlockReference`, the one `kvlearn.parts.check` judges
learners' managers by) knows nothing about hashes. It keeps the allocator's free pages and the
cached blocks nobody uses (each in the order they are handed out, and when each was freed), and for
every published block the whole token prefix (a tuple) whose KV that block completes. A new
sequence's cached prefix is then "the longest run of its full-block prefixes that some published
block holds", capped so the last token is always computed. On top of the reference, this test holds
the package's manager to its exact order: new blocks are the first ones of `free_block_ids`. Random
allocate / compute / append / deallocate steps, and misuse of deallocated sequences, are checked
after every step.
The number of examples comes from the hypothesis profile (150 in `make test`, 1,000 in
`make thorough`).
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn import BlockManager, KVCapacityError, Sequence
from kvlearn.parts.references import BlockReference
from tests.block_state import snapshot

# A 3-token alphabet and short blocks make prompts share prefixes (and hit the cache) often.
fresh_tokens = st.lists(st.integers(0, 2), max_size=8)


class BlockMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 2, 3, 4]), num_blocks=st.integers(1, 10),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size, num_blocks, caching):
        self.bs = block_size
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.ref = BlockReference(num_blocks, block_size, caching)
        self.live = []       # [sequence, tokens whose KV is computed]
        self.dead = []       # deallocated sequences
        self.prompts = []    # prompts and finished sequences, to build related prompts from
        self.hit_tokens = 0

    def check_new_blocks(self, new, problem):
        """The manager gave `new` blocks: allowed by the reference, and the first ones it listed as free."""
        assert problem is None, problem
        assert new == self.free_before[:len(new)]

    def release(self, entry):
        s = entry[0]
        self.m.deallocate(s)
        self.ref.release(s.seq_id)
        self.live.remove(entry)
        self.dead.append(s)
        self.prompts.append(list(s.token_ids))

    def unchanged(self, call, error, words):
        before = snapshot(self.m, [s for s, _ in self.live])
        with pytest.raises(error, match=words):
            call()
        assert snapshot(self.m, [s for s, _ in self.live]) == before

    # --- rules -----------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        tokens = data.draw(fresh_tokens)
        if self.prompts and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.prompts))
            tokens = base[:data.draw(st.integers(0, len(base)))] + tokens
        if not tokens:
            tokens = [0]
        s = Sequence(tokens, block_size=self.bs)
        hit = self.ref.hit(tokens)
        fits = self.ref.blocks_needed(len(tokens), hit) <= self.ref.num_free

        before = snapshot(self.m)
        assert self.m.num_cached_prefix(s) == len(hit) * self.bs
        assert self.m.can_allocate(s) == fits
        assert snapshot(self.m) == before  # queries change nothing, not even stats or LRU order
        if not fits:
            self.unchanged(lambda: self.m.allocate(s), KVCapacityError, "free blocks")
            return
        self.free_before = [b for b in self.m.free_block_ids if b not in hit]
        self.m.allocate(s)
        assert s.block_table[:len(hit)] == hit
        new = s.block_table[len(hit):]
        self.check_new_blocks(new, self.ref.allocate(s.seq_id, hit, new, s.num_tokens))
        assert s.num_cached_tokens == len(hit) * self.bs
        self.hit_tokens += s.num_cached_tokens
        self.live.append([s, s.num_cached_tokens])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        entry = data.draw(st.sampled_from(self.live))
        s, done = entry
        upto = data.draw(st.integers(done, min(s.num_tokens, len(s.block_table) * self.bs)))
        assert self.m.hash_blocks(s, upto) == self.ref.publish(s.seq_id, s.token_ids, upto)
        entry[1] = upto

    @precondition(lambda self: any(done == s.num_tokens for s, done in self.live))
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        entry = data.draw(st.sampled_from([e for e in self.live if e[1] == e[0].num_tokens]))
        s = entry[0]
        s.append_token(token)
        need = s.num_blocks - len(s.block_table)
        assert self.m.can_append(s) == (need <= self.ref.num_free)
        if need > self.ref.num_free:
            self.unchanged(lambda: self.m.may_append(s), KVCapacityError, "preempt")
            self.release(entry)  # preempted
            return
        self.free_before = self.m.free_block_ids
        self.m.may_append(s)
        self.check_new_blocks(s.block_table[len(s.block_table) - need:], self.ref.append(s.seq_id, s.block_table))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def deallocate(self, data):
        self.release(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: self.dead)
    @rule(data=st.data(), op=st.sampled_from(["deallocate", "may_append", "can_append", "hash_blocks"]))
    def misuse_a_deallocated_sequence(self, data, op):
        s = data.draw(st.sampled_from(self.dead))
        self.unchanged(lambda: getattr(self.m, op)(s), ValueError, "not allocated")

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def blocks_are_conserved_and_counted(self):
        if not hasattr(self, "m"):
            return
        refs, ref = self.ref.refs(), self.ref
        # the allocator's free pages, then the cached blocks least recently freed first, in the reference's order
        assert self.m.free_block_ids == ref.free + list(ref.cached)
        assert self.m.num_cached_free_blocks == len(ref.cached)
        assert all(b.ref_count == refs[b.block_id] >= 0 for b in self.m.blocks)
        in_use = sum(b.ref_count > 0 for b in self.m.blocks)
        assert self.m.num_free_blocks + in_use == self.m.num_blocks
        assert not (set(ref.free) | set(ref.cached)) & set(refs)
        assert all(self.m.blocks[b].hash is None for b in ref.free)  # a free page caches nothing
        assert self.m.stats.evicted_blocks == ref.evicted_blocks
        stats = self.m.stats
        assert (stats.queries, stats.query_tokens, stats.hit_blocks, stats.hit_tokens) == ref.counters

    @invariant()
    def only_full_computed_blocks_are_published(self):
        if not hasattr(self, "m"):
            return
        assert sorted(self.m.hash_to_block_id.values()) == sorted(self.ref.held)
        for h, b in self.m.hash_to_block_id.items():
            assert self.m.blocks[b].hash == h
            assert self.m.blocks[b].token_ids == list(self.ref.held[b][-self.bs:])
        for s, done in self.live:
            for j, b in enumerate(s.block_table):
                assert self.m.blocks[b].hash is None or (j + 1) * self.bs <= done

    @invariant()
    def last_token_is_never_cached(self):
        for s, _ in self.live:
            assert s.num_cached_tokens < s.num_tokens and s.num_cached_tokens % self.bs == 0
        if hasattr(self, "m"):
            assert self.m.stats.hit_tokens == self.hit_tokens


BlockMachine.TestCase.settings = settings(settings.default, stateful_step_count=30)
TestBlockStateMachine = BlockMachine.TestCase
