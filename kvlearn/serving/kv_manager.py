"""Chapter 6: the contract between the scheduler and a cache mode, and the bookkeeping they share.

The scheduler never touches slots, trees or blocks: it asks a `KVManager`, whose members each say
whether they are a query or a mutation; `kvlearn.serving.cache_modes` has its three cache modes.

Every mode keeps a running request's slots in one row of chapter 4's `ReqToTokenPool`, the table
attention reads a request's context through. The row, token by token:

    0 ........... prefix_len ............ num_computed ......... len(token_ids) ..... num_slots
    | cached prefix          | private, KV written  | computed this step   | spare slots of
    | (the cache's slots,    | (the request's own   | (fresh slots, KV     | the last page
    |  the request borrows)  |  slots)              |  written now)        |

After a forward, a caching mode may hand the computed head of the row to the cache:
- tokens the cache got meanwhile (another request inserted them): the request's copies are
  duplicates, freed at once, and the row switches to the cache's slots;
- the others: the cache takes the request's slots as they are;
so `prefix_len` grows to the computed length (whole pages; an unaligned tail stays private). When
the request leaves, its private slots go back to the pool and its hold on the prefix is released.
Counters: `num_computed` (where the next forward starts), `prefill_len` (where the prompt ends),
`prefix_len` (the cache's slots; blocks mode: chapter 2's `num_cached_tokens`).

Invariant (`check`, after every step, `python -O` included): free slots + slots held only by the
cache (evictable) + slots held by running requests (shared ones once) == pool size. A learner's
part (kvlearn.parts) that serves here is behind a guard (`kvlearn.serving.part_registry.served`);
when the invariant breaks with one in play, the error names it.

Faults: every mutation either completes or, when one of the calls it makes raises, leaves nothing
half done that a later call cannot finish: `admit` and `grow` undo what they took, and `release`
can be called again after a failure and completes the job (the scheduler's `abort` relies on it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvlearn.allocator import PageAllocator
from kvlearn.errors import PartError
from kvlearn.pool import KVPool, ReqToTokenPool
from kvlearn.serving.request import Request

DEFAULT_MAX_REQUESTS = 256  # rows of the ReqToTokenPool: requests that can run at once
# What `KVManager.counters` reports: KV moved below the pool and back (chapter 8's tiers; 0 elsewhere).
TIER_STATS = ("offloaded_tokens", "loaded_from_host_tokens", "loaded_from_disk_tokens")


@dataclass
class KVHandle:
    """What a KV manager keeps for one running request (`Request.kv`)."""

    row: int                 # its row in the manager's ReqToTokenPool
    num_slots: int = 0       # slots in the row (whole pages): at least the tokens with KV
    prefix_len: int = 0      # "none"/"radix": leading slots the cache owns, borrowed (blocks: 0)
    last_node: object = None  # radix: the locked tree node where the borrowed prefix ends


class KVManager(ABC):
    """Where the KV of every running request lives, for one cache mode over one pool."""

    name: str               # query: the cache mode
    caches_prefixes: bool   # query: whether a request can reuse KV that another one computed
    page_size: int          # query: tokens per page of the pool (a block, in "blocks" mode)
    pool: KVPool            # query: the pool whose slots the manager hands out

    def __init__(self, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        self.pool, self.page_size = pool, pool.page_size
        self.rows = ReqToTokenPool(min(max_requests, pool.num_slots // pool.page_size), pool.num_slots,
                                   device=pool.device)

    # --- queries ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Query: slots in the pool."""
        return self.pool.num_slots

    @property
    @abstractmethod
    def cache(self):
        """Query: the prefix cache itself (for pictures), or None."""

    @property
    @abstractmethod
    def evicted_tokens(self) -> int:
        """Query: cached tokens evicted so far, as counted by the structure that evicted them."""

    def fits(self, req: Request) -> bool:
        """Query: whether the request could run if it had the whole pool to itself."""
        return self._pages(req.max_tokens) * self.page_size <= self.capacity

    @abstractmethod
    def cached_len(self, token_ids: list[int]) -> int:
        """Query: tokens `admit` would take from the cache now (never the last one); changes
        nothing, not even an LRU clock, so a scheduler may ask about every waiting request."""

    def kv_indices(self, req: Request) -> torch.Tensor:
        """Query: slots of the request's whole context, this step's new tokens included."""
        return self.rows.req_to_token[req.kv.row, :len(req.token_ids)]

    @property
    def free_slots(self) -> int:
        """Query: slots nobody holds, not even the cache."""
        return self.pool.num_free

    @property
    @abstractmethod
    def evictable_slots(self) -> int:
        """Query: slots held only by the cache, which eviction can free."""

    @abstractmethod
    def slots_in_use(self, running: list[Request]) -> int:
        """Query: slots held by running requests, shared ones counted once."""

    def counters(self) -> dict[str, int]:
        """Query: cumulative counts of this manager's own, by name, that the engine adds to its stats:
        at least TIER_STATS (KV moved below the pool and back: none in chapter 6's modes, zeros)."""
        return dict.fromkeys(TIER_STATS, 0)

    def foreign_parts(self) -> list[tuple[str, object]]:
        """Query: (name, part) of the learner's parts whose answers this manager's counts rest on
        (a guard keeps its part as `part`)."""
        allocator = self.pool.allocator
        return [] if type(allocator) is PageAllocator else [("allocator", getattr(allocator, "part", allocator))]

    def check(self, running: list[Request]) -> None:
        """Query: slot conservation (free + evictable + in use == pool size) and one row per running
        request; a broken one raises (PartError naming the learner's parts in play, else RuntimeError)."""
        free, evictable, used = self.free_slots, self.evictable_slots, self.slots_in_use(running)
        if free + evictable + used != self.capacity:
            self.bookkeeping_broke(f"slot leak: {free} free + {evictable} evictable + {used} in use != {self.capacity}")
        live = len(self.rows.lengths) - self.rows.num_free
        if live != len(running):
            raise RuntimeError(f"a request row leaked: {live} rows are live for {len(running)} running requests; the "
                               "scheduler's running list and the KV manager disagree (a scheduler part that moves "
                               "requests itself, or a kvlearn bug: please report it).")

    def bookkeeping_broke(self, what: str):
        """Raise for a broken slot invariant: which parts' bookkeeping it rests on."""
        parts = self.foreign_parts()
        if not parts:
            raise RuntimeError(f"{what}: the package's own bookkeeping broke (no learner's part serves here): "
                               "this is a kvlearn bug, please report it.")
        raise PartError(" or ".join(name for name, _ in parts), ", ".join(type(p).__name__ for _, p in parts),
                        "the step's slot bookkeeping", what, "free slots (the allocator) + slots held only by the "
                        "cache + slots of running requests (the cache's counts and the rows) make the pool")

    # --- mutations -------------------------------------------------------------------------------
    @abstractmethod
    def admit(self, req: Request) -> int | None:
        """Mutation: give the request a row and slots for all its tokens, reusing its cached prefix;
        returns the cached length, or None, with nothing changed, when memory or rows are short."""

    @abstractmethod
    def grow(self, req: Request) -> bool:
        """Mutation: make sure the request's newest token has a slot; False, with nothing changed,
        when memory is short."""

    @abstractmethod
    def after_forward(self, req: Request, prefilled: bool) -> None:
        """Mutation: the forward wrote the KV of every token of `req.token_ids`; a caching mode may
        publish them."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """Mutation: the request finished or is preempted; its first `req.num_computed` tokens may
        go to the cache, everything else it holds goes back. Afterwards `req.kv` is None. Safe to
        call again after it raised."""

    @abstractmethod
    def evict_all(self) -> int:
        """Mutation: drop every cached token nobody uses; returns how many."""

    def flush(self) -> None:  # noqa: B027 (a hook with nothing to do by default, not an abstract method)
        """Mutation: write down whatever must outlive this manager (called by `Engine.close`, once
        no request runs); idempotent. Nothing here: a tiered manager (chapter 8) writes what its
        memory tiers hold to its disk tier."""

    # --- shared bookkeeping for subclasses --------------------------------------------------------
    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    def _open_row(self, req: Request, slots: torch.Tensor, prefix_len: int = 0, last_node=None) -> None:
        """Record the request's slots in a fresh row (the caller checked a row is free)."""
        req.kv = KVHandle(self.rows.alloc(slots), len(slots), prefix_len, last_node)

    def _close_row(self, req: Request) -> None:
        self.rows.free(req.kv.row)
        req.kv = None


class PoolPagesKV(KVManager):
    """"none" and "radix": a request takes its slots from the pool itself, a page at a time, evicting
    cached tokens nobody uses when the pool runs short ("blocks" takes them through a block manager)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Mutation: free at least `num_tokens` cached slots nobody uses (fewer if there are not
        that many); returns how many were freed."""

    def _alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots (whole pages), evicting if short; None, with nothing evicted, when even
        evicting everything unlocked would not make room."""
        if self.pool.num_free + self.evictable_slots < n:
            return None
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    def _admit_with_prefix(self, req: Request, prefix: torch.Tensor, last_node=None) -> int | None:
        """Admit with `prefix` (slots of the cached head, already protected by the caller)."""
        if not self.rows.num_free:
            return None
        new = self._alloc(self._pages(len(req.token_ids) - len(prefix)) * self.page_size)
        if new is None:
            return None
        try:
            self._open_row(req, torch.cat([prefix, new]), len(prefix), last_node)
        except BaseException:
            self.pool.free(new)
            raise
        return len(prefix)

    def grow(self, req: Request) -> bool:
        h = req.kv
        if len(req.token_ids) <= h.num_slots:
            return True
        new = self._alloc(self.page_size)
        if new is None:
            return False
        try:
            self.rows.write(h.row, h.num_slots, new)
        except BaseException:
            self.pool.free(new)
            raise
        h.num_slots += self.page_size
        return True

    def _free_private(self, req: Request) -> None:
        """Give the request's own slots back to the pool and its row back to the table."""
        h = req.kv
        self.pool.free(self.rows.req_to_token[h.row, h.prefix_len:h.num_slots])
        h.num_slots = h.prefix_len  # nothing private left, should closing the row fail
        self._close_row(req)
