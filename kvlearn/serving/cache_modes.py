"""Chapter 6: the three cache modes of the engine, each a `KVManager` (kvlearn.serving.kv_manager).

- `NoCacheKV`: every request computes its whole prompt in slots of its own and frees them at the end;
- `RadixKV`: chapter 3's radix tree over the pool's slots (SGLang's design): a request locks the
  prefix it reuses; its prompt joins the tree right after its prefill, prompt + output when it leaves;
- `BlockKV`: chapter 2's block manager (vLLM's design): a block is a page of the pool, taken through
  the pool's one allocator; full computed blocks are published by hash.

A learner's tree or block manager (kvlearn.parts) serves in the same modes behind a guard
(`kvlearn.serving.part_registry.served`); the package's own classes are called as they are.
"""

from __future__ import annotations

import torch

from kvlearn.blocks import BlockManager
from kvlearn.errors import check_choice
from kvlearn.pool import KVPool
from kvlearn.radix import RadixCache
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS, KVManager, PoolPagesKV
from kvlearn.serving.request import Request

CACHE_MODES = ("radix", "blocks", "none")
WRITE_POLICIES = ("write_back", "write_through")  # when chapter 8's tiers copy KV down (Engine(write_policy=...))
DEFAULT_BLOCK_SIZE = 16  # "blocks" mode's tokens per block (vLLM's default) when no page size is given


def default_page_size(cache: str) -> int:
    """Tokens per page of the pool when the user gives none: a block in "blocks" mode, else one."""
    return DEFAULT_BLOCK_SIZE if check_choice("cache", cache, CACHE_MODES) == "blocks" else 1


class NoCacheKV(PoolPagesKV):
    """No prefix cache: nothing is shared, nothing is ever evicted."""

    name, caches_prefixes = "none", False
    cache = None
    evicted_tokens = 0
    evictable_slots = 0

    def cached_len(self, token_ids: list[int]) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def admit(self, req: Request) -> int | None:
        return self._admit_with_prefix(req, torch.empty(0, dtype=torch.int64, device=self.pool.device))

    def after_forward(self, req: Request, prefilled: bool) -> None:
        pass

    def release(self, req: Request) -> None:
        self._free_private(req)

    def slots_in_use(self, running: list[Request]) -> int:
        return sum(r.kv.num_slots for r in running)

    def evict_all(self) -> int:
        return 0


class TrustedKeyRadixCache(RadixCache):
    """RadixKV's tree, which trusts list keys: they are requests' token ids, checked once when each
    `Request` was made (and tokens the sampler appended), so it does not check every id again on
    each call: on a thousand-token prompt that check costs more than the walk. Any other key is
    checked as usual."""

    def as_key(self, key) -> tuple:
        return tuple(key) if type(key) is list else super().as_key(key)


class RadixKV(PoolPagesKV):
    """Prefixes live in chapter 3's radix tree, whose values are this pool's slots.

    Locks: a running request holds one lock, on the tree node where its borrowed prefix ends; the
    tree's protected size is therefore exactly the running requests' shared prefixes.
    """

    name, caches_prefixes = "radix", True

    def __init__(self, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.tree = TrustedKeyRadixCache(page_size=pool.page_size, evict_callback=pool.free, device=pool.device)
        self._evicted = 0

    @property
    def cache(self) -> RadixCache:
        return self.tree

    @property
    def evicted_tokens(self) -> int:
        return self._evicted

    @property
    def evictable_slots(self) -> int:
        return self.tree.evictable_size

    def cached_len(self, token_ids: list[int]) -> int:
        return self.tree.match_len(token_ids[:-1])

    def evict(self, num_tokens: int) -> int:
        freed = self.tree.evict(num_tokens)
        self._evicted += freed
        return freed

    def admit(self, req: Request) -> int | None:
        # Match all but the last token: its logits are needed, so it is always computed.
        match = self.tree.match_prefix(req.token_ids[:-1])
        need = self._pages(len(req.token_ids) - len(match)) * self.page_size
        # Refuse before locking when even evicting everything but the match would not make room.
        spare = self.tree.evictable_size - self.tree.unlocked_on_path(match.last_node)
        if not self.rows.num_free or self.pool.num_free + spare < need:
            return None
        # Lock before allocating, so the eviction that allocation may trigger cannot take the match.
        self.tree.lock(match.last_node)
        try:
            return self._admit_with_prefix(req, match.indices, match.last_node)  # room was checked: not None
        except BaseException:
            self.tree.unlock(match.last_node)
            raise

    def after_forward(self, req: Request, prefilled: bool) -> None:
        if prefilled:  # publish the prompt at once, so requests admitted later share it
            self.cache_request(req, len(req.token_ids), keep_locked=True)

    def release(self, req: Request) -> None:
        self.cache_request(req, req.num_computed, keep_locked=False)  # the tree takes the computed head...
        self._free_private(req)                         # ...and the rest goes back to the pool

    def cache_request(self, req: Request, n: int, keep_locked: bool) -> None:
        """Mutation: hand the request's first `n` tokens (their KV computed) to the tree, keeping the
        lock on their path if `keep_locked` (SGLang's `cache_unfinished_req`; else its
        `cache_finished_req`); see the row diagram in kv_manager. Each step leaves the handle true
        before the next call that may fail, so running it again after a failure finishes the job."""
        h = req.kv
        # The tree may already hold more than `n` (an after_forward that failed half way): never less.
        key, slots = req.token_ids[:max(n, h.prefix_len)], self.rows.req_to_token[h.row]
        # 1. Tokens the tree got meanwhile (another request inserted them): the request's own slots
        #    for them are duplicates. Free them and point the row at the tree's slots. Comparing
        #    slots, not counting tokens, finds only what is still the request's.
        cached = self.tree.match_prefix(key).indices
        if len(cached) > h.prefix_len:   # (usually the tree got nothing more: nothing to compare)
            mine, theirs = slots[h.prefix_len:len(cached)], cached[h.prefix_len:]
            self.pool.free(mine[mine != theirs])
            mine.copy_(theirs)
            h.prefix_len = len(cached)
        # 2. The rest joins the tree as it is: the tree owns those slots now.
        _, match = self.tree.insert_prefix(key, slots[:len(key)])
        h.prefix_len = len(match)
        # Hand the lock over. SGLang's order: release the old node, then lock the new one. That is
        # safe because nothing can evict in between (one thread, no allocation between the calls).
        if h.last_node is not None:
            self.tree.unlock(h.last_node)
            h.last_node = None
        if keep_locked:
            self.tree.lock(match.last_node)
            h.last_node = match.last_node

    def slots_in_use(self, running: list[Request]) -> int:
        # Locked paths are exactly the running requests' prefixes; the rest of each row is private.
        return self.tree.protected_size + sum(r.kv.num_slots - r.kv.prefix_len for r in running)

    def evict_all(self) -> int:
        return self.evict(self.tree.evictable_size)


class BlockKV(KVManager):
    """Prefixes are chapter 2's hashed full blocks; a block is one page of the pool.

    A block whose last user leaves stays cached if it holds a published prefix, and is evicted
    (its page reused) only when the pool has no free page left: this mode evicts lazily, inside
    the block manager, which also counts what it evicted.
    """

    name, caches_prefixes = "blocks", True

    def __init__(self, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.manager = BlockManager(pool.num_slots // pool.page_size, pool.page_size, allocator=pool.allocator)

    @property
    def cache(self) -> BlockManager:
        return self.manager

    @property
    def evicted_tokens(self) -> int:
        return self.manager.stats.evicted_blocks * self.page_size

    @property
    def evictable_slots(self) -> int:
        return self.manager.num_cached_free_blocks * self.page_size

    def cached_len(self, token_ids: list[int]) -> int:
        return self.manager.num_cached_prefix(token_ids)

    def _table_slots(self, block_ids: list[int]) -> torch.Tensor:
        return self.pool.slots_of(torch.tensor(block_ids, dtype=torch.int64, device=self.pool.device))

    def admit(self, req: Request) -> int | None:
        if not self.rows.num_free or not self.manager.can_allocate(req):
            return None
        self.manager.allocate(req)  # fills req.block_table and req.num_cached_tokens
        try:
            self._open_row(req, self._table_slots(req.block_table))
        except BaseException:
            self.manager.deallocate(req)
            raise
        return req.num_cached_tokens

    def grow(self, req: Request) -> bool:
        h = req.kv
        if len(req.token_ids) <= h.num_slots:
            return True
        if not self.manager.can_append(req):
            return False
        self.manager.may_append(req)  # one new block: the newest token starts it
        self.rows.write(h.row, h.num_slots, self._table_slots(req.block_table[-1:]))
        h.num_slots += self.page_size
        return True

    def after_forward(self, req: Request, prefilled: bool) -> None:
        self.manager.hash_blocks(req)

    def release(self, req: Request) -> None:
        if req.block_table:  # empty when an earlier call got this far
            self.manager.deallocate(req)
        self._close_row(req)

    def slots_in_use(self, running: list[Request]) -> int:
        used_blocks = self.manager.num_blocks - self.manager.num_free_blocks
        return used_blocks * self.page_size

    def check(self, running: list[Request]) -> None:
        """Also the block form of the rule: the blocks in use are exactly those in live tables."""
        super().check(running)
        held = {b for r in running for b in r.block_table}
        used = self.manager.num_blocks - self.manager.num_free_blocks
        if len(held) != used:
            self.bookkeeping_broke(f"block leak: {used} blocks in use but running requests hold {len(held)}")

    def evict_all(self) -> int:
        return self.manager.evict_cached()


def make_kv_manager(cache: str, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS) -> KVManager:
    """The KV manager for a cache mode: "radix", "blocks" (blocks of pool.page_size) or "none"."""
    modes = {"radix": RadixKV, "blocks": BlockKV, "none": NoCacheKV}
    return modes[check_choice("cache", cache, CACHE_MODES)](pool, max_requests)
