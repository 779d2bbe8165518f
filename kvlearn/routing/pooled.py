"""A prefix cache that every replica reads: the fleet's pooled KV store (Figure 10 of Mooncake).

Chapter 8 kept evicted KV below one engine's pool, in its host memory and on its disk. Mooncake
Store and LMCache go one step further: the KV lives in a store *shared by every engine* (the DRAM
and SSDs of the whole cluster), so a prefix computed on one replica can be loaded by any other.
The model here keeps only what that changes for a router:

- `PrefixPool`: one LRU prefix cache of `capacity_tokens` (None: unbounded), chapter 3's radix
  tree over token ids in pages. A read (`lookup`) is a use; a write (`store`) inserts a prompt's
  whole pages and evicts least recently used leaves while the pool holds more than its capacity
  (never the path just written, unless that path alone is larger than the pool). No slots, no K
  or V: the pool only says which prefixes it holds. `replay` (Figure 9) is one PrefixPool fed
  every request in order.
- `PooledRadixKV`: chapter 6's radix mode on a replica's KV pool (chapter 4), with the shared
  `PrefixPool` below it: a tier (chapter 8) that every replica reads. Admission takes the local
  match as usual, then *loads* whatever longer prefix the shared pool holds into the request's
  fresh slots: those tokens count as cached (the scheduler computes only the rest) and as
  `loaded_from_host_tokens` (the shared pool is the fleet's host memory); the fleet's time model
  charges `load_s_per_token` for each (`TimeModel`). `cached_len` (what `lpm` scheduling and the
  `exact` router ask) counts the shared pool too. A prompt is written to the shared pool as soon
  as its prefill ends, as Mooncake's prefill nodes write their KV to the store (write-through).

Invariants: the pool never holds more than `capacity_tokens // page_size` pages between calls;
everything it holds was computed by some replica first, so a pooled fleet still computes at least
the trace's `unique_token_floor`.
"""

from __future__ import annotations

import math

import torch

from kvlearn.errors import check_int, check_positive_int
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import RadixKV, TrustedKeyRadixCache
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.request import Request

# Seconds to load one token's KV from the pool: chapter 8 measured a load from host memory at about
# 3 us per token of SmolLM2 (45 KiB) and from disk at about 18 us, on the course's CPU; a remote store
# adds the network (45 KiB over a 200 Gb/s RDMA link: 1.8 us). 20 us: the slowest, rounded up.
POOL_LOAD_S_PER_TOKEN = 20e-6


class PrefixPool:
    """One bounded LRU prefix cache of token ids, in pages (see the module docstring)."""

    def __init__(self, capacity_tokens: int | None, page_size: int = 1, eviction_policy: str = "lru"):
        if capacity_tokens is not None:
            check_int("capacity_tokens", capacity_tokens, what=" (tokens the pool holds; None: unbounded)")
        check_positive_int("page_size", page_size, " (tokens per page)")
        self.capacity_tokens, self.page_size = capacity_tokens, page_size
        self.limit = math.inf if capacity_tokens is None else capacity_tokens // page_size * page_size
        self.tree = TrustedKeyRadixCache(page_size, eviction_policy=eviction_policy)   # keys: requests' token ids
        self._values = torch.zeros(0, dtype=torch.int64)   # the tree needs values; nothing reads them
        self.stored_tokens = self.evicted_tokens = 0

    @property
    def size(self) -> int:
        """Tokens the pool holds."""
        return self.tree.total_size

    def match_len(self, token_ids) -> int:
        """Query: tokens of `token_ids` (whole pages) the pool holds; changes nothing."""
        return self.tree.match_len(token_ids)

    def lookup(self, token_ids) -> int:
        """Tokens of `token_ids` (whole pages) the pool holds; a read: touches their pages."""
        return len(self.tree.match_prefix(token_ids))

    def store(self, token_ids) -> int:
        """Write the whole pages of `token_ids`, then evict to capacity; returns the tokens written
        that the pool did not hold."""
        n = len(token_ids)
        if len(self._values) < n:
            self._values = torch.zeros(max(n, 2 * len(self._values)), dtype=torch.int64)
        held, path = self.tree.insert_prefix(token_ids, self._values[:n])
        new = len(path) - held
        self.stored_tokens += new
        if self.tree.total_size > self.limit:
            self.tree.lock(path.last_node)            # the path just written stays...
            self.evicted_tokens += self.tree.evict(self.tree.total_size - self.limit)
            self.tree.unlock(path.last_node)
            if self.tree.total_size > self.limit:     # ...unless it alone outgrows the pool
                self.evicted_tokens += self.tree.evict(self.tree.total_size - self.limit)
        return new

    def __repr__(self) -> str:
        capacity = "unbounded" if self.capacity_tokens is None else f"{self.capacity_tokens:,}"
        return (f"PrefixPool({self.size:,} of {capacity} tokens, pages of {self.page_size}, "
                f"{self.stored_tokens:,} stored, {self.evicted_tokens:,} evicted)")


class PooledRadixKV(RadixKV):
    """Chapter 6's radix mode over a replica's KV pool, loading longer prefixes from a shared
    `PrefixPool` (see the module docstring). `shared.page_size` must be the KV pool's page size."""

    def __init__(self, pool: KVPool, shared: PrefixPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        if shared.page_size != pool.page_size:
            raise ValueError(f"the shared pool's pages ({shared.page_size} tokens) must be the replica's "
                             f"({pool.page_size}).")
        super().__init__(pool, max_requests)
        self.shared = shared
        self.loaded_tokens = 0

    def cached_len(self, token_ids: list[int]) -> int:
        return max(super().cached_len(token_ids), self.shared.match_len(token_ids[:-1]))

    def admit(self, req: Request) -> int | None:
        local = super().admit(req)
        if local is None:
            return None
        # tokens past the local match that the pool holds: loaded into the request's fresh slots
        loaded = max(0, self.shared.lookup(req.token_ids[:-1]) - local)
        self.loaded_tokens += loaded
        return local + loaded

    def after_forward(self, req: Request, prefilled: bool) -> None:
        super().after_forward(req, prefilled)
        if prefilled:
            self.shared.store(req.token_ids[:req.num_prompt_tokens])

    def counters(self) -> dict[str, int]:
        return super().counters() | {"loaded_from_host_tokens": self.loaded_tokens}
