"""BlockManager against a brute-force reference, driven by hypothesis.

The reference knows nothing about hashes. It keeps the allocator's free pages and the cached
blocks nobody uses as two plain lists, and for every published block the whole token prefix (a
tuple) whose KV that block completes. A new sequence's
cached prefix is then "the longest run of its full-block prefixes that some published block
holds", capped so the last token is always computed. Random allocate / compute / append /
deallocate steps, and misuse of deallocated sequences, are checked against it after every step.
The number of examples comes from the hypothesis profile (1,000 by default, 10,000 with
HYPOTHESIS_PROFILE=thorough).
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn import BlockManager, KVCapacityError, Sequence
from tests.block_state import snapshot

# A 3-token alphabet and short blocks make prompts share prefixes (and hit the cache) often.
fresh_tokens = st.lists(st.integers(0, 2), max_size=8)


class BlockMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 2, 3, 4]), num_blocks=st.integers(1, 10),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size, num_blocks, caching):
        self.bs = block_size
        self.caching = caching
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.stack = list(range(num_blocks))  # the allocator: handed out from the front, freed to the front
        self.cached = []     # published blocks nobody uses: least recently freed at the front
        self.held = {}       # published and findable block id -> token prefix its KV completes
        self.hashed = set()  # block ids that carry a hash (findable, or a duplicate of one that is)
        self.live = []       # [sequence, tokens whose KV is computed]
        self.dead = []       # deallocated sequences
        self.prompts = []    # prompts and finished sequences, to build related prompts from
        self.hit_tokens = 0

    # --- reference helpers -----------------------------------------------------------------
    def refs(self):
        return Counter(b for s, _ in self.live for b in s.block_table)

    def expected_hit(self, tokens):
        findable = {prefix: b for b, prefix in self.held.items()}
        hit = []
        for j in range((len(tokens) - 1) // self.bs):  # the last token is always computed
            block_id = findable.get(tuple(tokens[:(j + 1) * self.bs]))
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    @property
    def num_free(self):
        return len(self.stack) + len(self.cached)

    def forget(self, b):
        self.held.pop(b, None)
        self.hashed.discard(b)

    def take_free(self, n):
        fresh = min(n, len(self.stack))
        taken, self.stack = self.stack[:fresh], self.stack[fresh:]
        evicted, self.cached = self.cached[:n - fresh], self.cached[n - fresh:]
        for b in evicted:  # reused: whatever it cached is gone
            self.forget(b)
        return taken + evicted

    def release(self, entry):
        s = entry[0]
        table = list(s.block_table)
        self.m.deallocate(s)
        self.live.remove(entry)
        refs, released = self.refs(), []
        for b in reversed(table):
            if refs[b]:
                continue
            if b in self.held:
                self.cached.append(b)
            else:
                self.forget(b)
                released.append(b)
        self.stack = released[::-1] + self.stack
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
        hit = self.expected_hit(tokens) if self.caching else []
        refs = self.refs()
        fits = s.num_blocks - sum(refs[b] > 0 for b in hit) <= self.num_free

        before = snapshot(self.m)
        assert self.m.num_cached_prefix(s) == len(hit) * self.bs
        assert self.m.can_allocate(s) == fits
        assert snapshot(self.m) == before  # queries change nothing, not even stats or LRU order
        if not fits:
            self.unchanged(lambda: self.m.allocate(s), KVCapacityError, "free blocks")
            return
        self.m.allocate(s)
        self.cached = [b for b in self.cached if b not in hit]
        assert s.block_table == hit + self.take_free(s.num_blocks - len(hit))
        assert s.num_cached_tokens == len(hit) * self.bs
        self.hit_tokens += s.num_cached_tokens
        self.live.append([s, s.num_cached_tokens])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        entry = data.draw(st.sampled_from(self.live))
        s, done = entry
        upto = data.draw(st.integers(done, min(s.num_tokens, len(s.block_table) * self.bs)))
        self.m.hash_blocks(s, upto)
        entry[1] = upto
        if not self.caching:
            return
        for j in range(upto // self.bs):
            b = s.block_table[j]
            if b not in self.hashed:
                self.hashed.add(b)
                prefix = tuple(s.token_ids[:(j + 1) * self.bs])
                if prefix not in self.held.values():  # one findable copy per prefix
                    self.held[b] = prefix

    @precondition(lambda self: any(done == s.num_tokens for s, done in self.live))
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        entry = data.draw(st.sampled_from([e for e in self.live if e[1] == e[0].num_tokens]))
        s = entry[0]
        s.append_token(token)
        need = s.num_blocks - len(s.block_table)
        assert self.m.can_append(s) == (need <= self.num_free)
        if need > self.num_free:
            self.unchanged(lambda: self.m.may_append(s), KVCapacityError, "preempt")
            self.release(entry)  # preempted
            return
        self.m.may_append(s)
        assert s.block_table[len(s.block_table) - need:] == self.take_free(need)

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
        refs = self.refs()
        assert self.m.free_block_ids == self.stack + self.cached  # exact allocator and LRU order
        assert self.m.num_cached_free_blocks == len(self.cached)
        assert all(b.ref_count == refs[b.block_id] >= 0 for b in self.m.blocks)
        in_use = sum(b.ref_count > 0 for b in self.m.blocks)
        assert self.m.num_free_blocks + in_use == self.m.num_blocks
        assert not set(self.stack + self.cached) & set(refs)
        assert all(self.m.blocks[b].hash is None for b in self.stack)  # a free page caches nothing

    @invariant()
    def only_full_computed_blocks_are_published(self):
        assert sorted(self.m.hash_to_block_id.values()) == sorted(self.held)
        for h, b in self.m.hash_to_block_id.items():
            assert self.m.blocks[b].hash == h
            assert self.m.blocks[b].token_ids == list(self.held[b][-self.bs:])
        for s, done in self.live:
            for j, b in enumerate(s.block_table):
                assert self.m.blocks[b].hash is None or (j + 1) * self.bs <= done

    @invariant()
    def last_token_is_never_cached(self):
        for s, _ in self.live:
            assert s.num_cached_tokens < s.num_tokens and s.num_cached_tokens % self.bs == 0
        assert self.m.stats.hit_tokens == self.hit_tokens


BlockMachine.TestCase.settings = settings(settings.default, stateful_step_count=30)
TestBlockStateMachine = BlockMachine.TestCase
