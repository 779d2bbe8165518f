"""KV managers: where a request's KV lives, one manager per cache mode of the engine.

All three offer the same small interface to the scheduler (`fits`, `cached_len`, `admit`, `grow`,
`kv_indices`, `after_forward`, `release`, `check`, `evict_all`):

- `NoCacheKV`: every request takes slots of its own from the pool and gives them back at the end;
- `RadixKV`: chapter 3's radix tree over the pool's slots; a request locks the prefix it reuses,
  and its prompt (after its prefill) and finally prompt + output join the tree;
- `BlockKV`: chapter 2's block manager, which owns every slot of the pool as fixed-size blocks.

Invariant (the scheduler calls `check` after every step): free slots + evictable cached slots +
slots used by live requests (shared ones once) == pool size. NoCacheKV and RadixKV count each term
separately; in BlockKV free slots are derived from the block counts, so its check is the block
form of the same rule: the blocks in use are exactly those in live requests' block tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlearn.blocks import BlockManager
from kvlearn.pool import KVPool
from kvlearn.radix import RadixCache
from kvlearn.sequence import Sequence

if TYPE_CHECKING:
    from kvlearn.serving.scheduler import Request

CACHE_MODES = ("radix", "blocks", "none")


class _Slots:
    """A request's slot list (SGLang's req_to_token row): slot of token i at `slots[i]`.

    `num_slots` entries are filled (whole pages); the first `prefix_len` belong to the cache, and
    `last_node` (radix only) is the locked tree node they end at.
    """

    __slots__ = ("slots", "num_slots", "prefix_len", "last_node")

    def __init__(self, capacity: int, device):
        self.slots = torch.empty(capacity, dtype=torch.int64, device=device)
        self.num_slots = 0
        self.prefix_len = 0
        self.last_node = None


class NoCacheKV:
    """Every request computes its whole prompt in slots of its own and frees them when it leaves."""

    name = "none"
    caches_prefixes = False

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.page_size = pool.page_size
        self.evicted_tokens = 0
        self.cache = None  # the prefix cache itself, for pictures: none here

    @property
    def capacity(self) -> int:
        return self.pool.num_slots

    def fits(self, req: Request) -> bool:
        """Whether the request could run if it had the whole pool to itself."""
        return self._pages(req.max_tokens) * self.page_size <= self.capacity

    def cached_len(self, token_ids: list[int]) -> int:
        """Tokens `admit` would take from the cache now (the last token is always computed)."""
        return 0

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    def _alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots (whole pages), evicting cached tokens if short; None, with the cache left
        intact, when even evicting everything unlocked would not make room."""
        if self.pool.num_free + self.evictable_slots < n:
            return None
        if self.pool.num_free < n:
            self._evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    def _evict(self, num_tokens: int) -> None:
        pass

    def admit(self, req: Request) -> bool:
        """Give the request slots for all its tokens; False (nothing changed) when memory is short."""
        return self._admit(req, _Slots(self._pages(req.max_tokens) * self.page_size, self.pool.device))

    def _admit(self, req: Request, state: _Slots) -> bool:
        need = self._pages(len(req.token_ids) - state.prefix_len) * self.page_size
        new = self._alloc(need)
        if new is None:
            return False
        state.slots[state.prefix_len:state.prefix_len + need] = new
        state.num_slots = state.prefix_len + need
        req.kv_state, req.num_computed = state, state.prefix_len
        return True

    def grow(self, req: Request) -> bool:
        """Make sure the request's newest token has a slot; False when memory is short."""
        state = req.kv_state
        if len(req.token_ids) <= state.num_slots:
            return True
        new = self._alloc(self.page_size)
        if new is None:
            return False
        state.slots[state.num_slots:state.num_slots + self.page_size] = new
        state.num_slots += self.page_size
        return True

    def kv_indices(self, req: Request) -> torch.Tensor:
        """Slots of the request's whole context, the tokens to compute this step included."""
        return req.kv_state.slots[:len(req.token_ids)]

    def after_forward(self, req: Request, prefilled: bool) -> None:
        """Called once the forward has written the KV of all the request's tokens."""
        req.num_computed = len(req.token_ids)

    def release(self, req: Request) -> None:
        """The request finished or is preempted: give back (or hand to the cache) its slots."""
        state = req.kv_state
        self.pool.free(state.slots[state.prefix_len:state.num_slots])
        req.kv_state, req.num_computed = None, 0

    @property
    def free_slots(self) -> int:
        """Slots nobody uses and the cache does not hold."""
        return self.pool.num_free

    @property
    def evictable_slots(self) -> int:
        """Slots held only by the cache: free-able by eviction."""
        return 0

    def slots_in_use(self, running: list[Request]) -> int:
        """Slots referenced by live requests, shared ones counted once."""
        return sum(r.kv_state.num_slots for r in running)

    def check(self, running: list[Request]) -> None:
        """Slot conservation: free + evictable + used by live requests == pool size."""
        free, evictable, used = self.free_slots, self.evictable_slots, self.slots_in_use(running)
        assert free + evictable + used == self.capacity, (
            f"slot leak: {free} free + {evictable} evictable + {used} in use != {self.capacity}")

    def evict_all(self) -> int:
        """Drop every cached token nobody uses; returns how many."""
        return 0


class RadixKV(NoCacheKV):
    """Prefixes live in chapter 3's radix tree, whose values are this pool's slots.

    A request locks the tree path of its cached prefix while it runs. Its prompt is inserted right
    after its prefill (so requests admitted later share it at once), and (prompt + output)[:-1],
    every token with KV, when it leaves.
    """

    name = "radix"
    caches_prefixes = True

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.tree = self.cache = RadixCache(page_size=pool.page_size, evict_callback=pool.free,
                                            device=pool.device)

    def cached_len(self, token_ids: list[int]) -> int:
        return len(self.tree.match_prefix(token_ids[:-1]))

    def _evict(self, num_tokens: int) -> None:
        self.evicted_tokens += self.tree.evict(num_tokens)

    def admit(self, req: Request) -> bool:
        # Match all but the last token: its logits are needed, so it is always computed.
        match = self.tree.match_prefix(req.token_ids[:-1])
        # Lock before allocating, so the eviction that allocation may trigger cannot take it.
        self.tree.lock(match.last_node)
        state = _Slots(self._pages(req.max_tokens) * self.page_size, self.pool.device)
        state.slots[:len(match)] = match.indices
        state.prefix_len, state.last_node = len(match), match.last_node
        if not self._admit(req, state):
            self.tree.unlock(match.last_node)
            return False
        return True

    def after_forward(self, req: Request, prefilled: bool) -> None:
        super().after_forward(req, prefilled)
        if prefilled:
            self._insert(req, keep_locked=True)

    def release(self, req: Request) -> None:
        self._insert(req, keep_locked=False)  # the tree takes the computed head: free only the tail
        super().release(req)

    def _insert(self, req: Request, keep_locked: bool) -> None:
        """Hand the request's computed tokens to the tree; the tree now owns their slots.

        Where the tree already held some of them (another request inserted them meanwhile), the
        request's copies are freed and it switches to the tree's slots.
        """
        state, n = req.kv_state, req.num_computed
        key, old = req.token_ids[:n], state.last_node
        present = self.tree.insert(key, state.slots[:n])
        if present > state.prefix_len:
            self.pool.free(state.slots[state.prefix_len:present])
        stored = n // self.page_size * self.page_size
        if keep_locked:
            match = self.tree.match_prefix(key)
            state.slots[:len(match)] = match.indices
            self.tree.lock(match.last_node)
            state.last_node = match.last_node
        self.tree.unlock(old)
        state.prefix_len = stored

    @property
    def evictable_slots(self) -> int:
        return self.tree.evictable_size

    def slots_in_use(self, running: list[Request]) -> int:
        # The locked paths are exactly the running requests' prefixes; the rest is their own.
        return self.tree.protected_size + sum(r.kv_state.num_slots - r.kv_state.prefix_len for r in running)

    def evict_all(self) -> int:
        freed = self.tree.evict(self.tree.evictable_size)
        self.evicted_tokens += freed
        return freed


class BlockKV:
    """Prefixes are chapter 2's hashed full blocks; the block manager owns every slot of the pool.

    The pool hands all its slots over once, at construction (block b is slots
    b*block_size .. b*block_size + block_size - 1). A block freed by a finished request keeps its
    hash until the free list hands it out again: that reuse is this mode's eviction.
    """

    name = "blocks"
    caches_prefixes = True

    def __init__(self, pool: KVPool):
        # A block is one page of the pool (the pool keeps num_slots a multiple of page_size).
        pool.alloc(pool.num_slots)  # every slot now belongs to the block manager
        self.pool, self.page_size = pool, pool.page_size
        self.manager = self.cache = BlockManager(pool.num_slots // pool.page_size, pool.page_size,
                                                 enable_prefix_caching=True)
        self.evicted_tokens = 0

    @property
    def capacity(self) -> int:
        return self.pool.num_slots

    def fits(self, req: Request) -> bool:
        return -(-req.max_tokens // self.page_size) <= self.manager.num_blocks

    def cached_len(self, token_ids: list[int]) -> int:
        return self.manager.num_cached_prefix(Sequence(token_ids, self.page_size))

    def _counting_evictions(self, allocate) -> None:
        # A reused free block that still had a published hash is a cache entry evicted.
        before = len(self.manager.hash_to_block_id)
        allocate()
        self.evicted_tokens += (before - len(self.manager.hash_to_block_id)) * self.page_size

    def admit(self, req: Request) -> bool:
        seq = Sequence(req.token_ids, self.page_size)
        if not self.manager.can_allocate(seq):
            return False
        self._counting_evictions(lambda: self.manager.allocate(seq))
        req.kv_state, req.num_computed = seq, seq.num_cached_tokens
        return True

    def grow(self, req: Request) -> bool:
        seq = req.kv_state
        if seq.num_tokens == len(req.token_ids):
            return True
        # Check the block boundary before appending, so a refusal leaves the sequence untouched.
        if seq.num_tokens % self.page_size == 0 and self.manager.num_free_blocks == 0:
            return False
        seq.append_token(req.token_ids[-1])
        self._counting_evictions(lambda: self.manager.may_append(seq))
        return True

    def kv_indices(self, req: Request) -> torch.Tensor:
        seq = req.kv_state
        return self.manager.slot_mapping(seq, 0, seq.num_tokens, device=self.pool.device)

    def after_forward(self, req: Request, prefilled: bool) -> None:
        req.num_computed = len(req.token_ids)
        self.manager.hash_blocks(req.kv_state)  # every token of the sequence has KV now

    def release(self, req: Request) -> None:
        self.manager.deallocate(req.kv_state)
        req.kv_state, req.num_computed = None, 0

    def _used_blocks(self) -> int:
        return self.manager.num_blocks - self.manager.num_free_blocks

    def slots_in_use(self, running: list[Request]) -> int:
        return self._used_blocks() * self.page_size

    @property
    def evictable_slots(self) -> int:
        """Slots of free blocks that still hold a published prefix."""
        return self.manager.num_cached_free_blocks * self.page_size

    @property
    def free_slots(self) -> int:
        return self.manager.num_free_blocks * self.page_size - self.evictable_slots

    def check(self, running: list[Request]) -> None:
        """Block conservation: the blocks in use are exactly those in live requests' tables."""
        held = {b for r in running for b in r.kv_state.block_table}
        assert len(held) == self._used_blocks(), (
            f"block leak: {self._used_blocks()} blocks in use but live requests hold {len(held)}")

    def evict_all(self) -> int:
        """Forget every published block nobody uses (their slots are already free)."""
        freed = self.manager.evict_cached()
        self.evicted_tokens += freed
        return freed


def make_kv_manager(cache: str, pool: KVPool):
    """The KV manager for a cache mode: "radix", "blocks" (blocks of pool.page_size) or "none"."""
    if cache == "radix":
        return RadixKV(pool)
    if cache == "blocks":
        return BlockKV(pool)
    if cache == "none":
        return NoCacheKV(pool)
    raise ValueError(f"Unknown cache {cache!r}: choose one of {', '.join(CACHE_MODES)}.")
