"""The scheduler: which requests run in the next step, and where their KV lives.

Every step forms one batch under a token budget (`max_batch_tokens`):

1. every running request decodes one token; a request that needs a new slot and cannot get one,
   even after evicting unlocked cached tokens, makes the scheduler preempt the most recently
   admitted request (vLLM's recompute preemption: its slots go back and it re-queues);
2. waiting requests are admitted, in `fcfs` order or `lpm` order (longest cached prefix first,
   SGLang's policy), while the budget and the pool allow; each computes only its uncached suffix.

A request that shares a not-yet-computed prefix with one admitted in the same step waits a step:
its partner's prompt is published to the cache right after its prefill, so the prefix is computed
once (SGLang's in-batch prefix check).

The KV side is one of three managers behind the same small interface (`admit`, `grow`,
`after_forward`, `release`, `kv_indices`): `NoCacheKV` (slots from the pool, nothing shared),
`RadixKV` (chapter 3's tree over the pool's slots) and `BlockKV` (chapter 2's block manager, which
owns the pool's slots as blocks).

Invariant (checked after every step): free slots + evictable cached slots + slots used by live
requests (shared ones once) == pool size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvlearn.blocks import BlockManager
from kvlearn.pool import KVPool
from kvlearn.radix import RadixCache
from kvlearn.sequence import Sequence

CACHE_MODES = ("radix", "blocks", "none")
SCHEDULES = ("fcfs", "lpm")
# lpm sorts the queue by a prefix match per request; past this length it costs more than it
# saves, and the scheduler falls back to fcfs (SGLang does the same).
LPM_MAX_QUEUE = 128


class Request:
    """One generation request: its tokens so far and where it is in its life.

    `token_ids` is the prompt followed by the generated tokens. The KV of the first
    `num_computed` tokens is in the slots the request holds; the last generated token never has
    KV until the next step computes it. `status` is "waiting", "running" or "finished".
    """

    def __init__(self, rid: int, prompt_ids: list[int], max_new_tokens: int):
        self.rid = rid
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.status = "waiting"
        self.num_computed = 0
        self.num_preemptions = 0
        self.kv_state = None  # the KV manager's handle: slots and a tree lock, or a Sequence

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_tokens(self) -> int:
        """Most tokens this request ever holds KV for: its last token never needs any."""
        return self.num_prompt_tokens + self.max_new_tokens - 1

    def __repr__(self) -> str:
        return (f"Request(r{self.rid}, {self.status}, {self.num_prompt_tokens} prompt + "
                f"{len(self.output_ids)} output tokens, {self.num_computed} with KV)")


# --- KV managers ------------------------------------------------------------------------------

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
        """`n` slots (whole pages), evicting cached tokens if short; None when the pool cannot."""
        if self.pool.num_free < n:
            self._evict(n - self.pool.num_free)
        return self.pool.alloc(n) if self.pool.num_free >= n else None

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
        self._insert(req, keep_locked=False)
        state = req.kv_state
        self.pool.free(state.slots[state.prefix_len:state.num_slots])  # the tail the tree did not take
        req.kv_state, req.num_computed = None, 0

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

    def __init__(self, pool: KVPool, block_size: int):
        if pool.num_slots % block_size:
            raise ValueError(f"The pool's {pool.num_slots} slots are not a whole number of {block_size}-token "
                             f"blocks: use a multiple of {block_size}.")
        pool.alloc(pool.num_slots)  # every slot now belongs to the block manager
        self.pool, self.page_size = pool, block_size
        self.manager = self.cache = BlockManager(pool.num_slots // block_size, block_size,
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
        return BlockKV(pool, pool.page_size)
    if cache == "none":
        return NoCacheKV(pool)
    raise ValueError(f"Unknown cache {cache!r}: choose one of {', '.join(CACHE_MODES)}.")


# --- the scheduler ----------------------------------------------------------------------------

@dataclass
class Batch:
    """One step's work: for each request, the tokens to compute and its whole context's slots."""

    requests: list[Request] = field(default_factory=list)
    input_ids: list[list[int]] = field(default_factory=list)
    kv_indices: list[torch.Tensor] = field(default_factory=list)
    num_prefills: int = 0  # the first num_prefills requests prefill, the rest decode

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepReport:
    """What one step did, for logs and notebooks. Prefills are (rid, cached, computed) tokens."""

    step: int
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    evicted_tokens: int = 0
    used_slots: int = 0       # by live requests, shared slots once (after this step's admissions)
    evictable_slots: int = 0  # held only by the cache
    free_slots: int = 0

    def __repr__(self) -> str:
        parts = [f"step {self.step}:"]
        if self.prefills:
            parts.append("prefill " + ", ".join(f"r{r} ({c} cached + {n} computed)" for r, c, n in self.prefills))
        if self.decodes:
            parts.append("decode " + " ".join(f"r{r}" for r in self.decodes))
        for label, rids in (("deferred", self.deferred), ("preempted", self.preempted),
                            ("finished", self.finished)):
            if rids:
                parts.append(f"{label} " + " ".join(f"r{r}" for r in rids))
        if self.evicted_tokens:
            parts.append(f"evicted {self.evicted_tokens} tokens")
        parts.append(f"| slots: {self.used_slots} in use, {self.evictable_slots} cached, {self.free_slots} free")
        return " ".join(parts)


STAT_NAMES = ("requests", "prompt_tokens", "computed_prefill_tokens", "cached_tokens", "output_tokens",
              "evicted_tokens", "preemptions", "peak_slots", "steps")


class Scheduler:
    """Continuous batching over a KV manager: `schedule()` a batch, run it, `postprocess()` it.

    in_batch_threshold: a waiting request whose prompt shares at least this many more tokens with
    a request admitted in the same step than with the cache waits one step (0 turns it off).
    `stats` counts since the last `reset_stats()`: prefill counts include recomputation after a
    preemption; peak_slots is the most slots live requests used at once, shared slots once.
    """

    def __init__(self, kv, max_batch_tokens: int = 2048, schedule: str = "fcfs",
                 eos_token_ids=(), in_batch_threshold: int = 1):
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be an int >= 1, got {max_batch_tokens!r}.")
        self.kv, self.max_batch_tokens, self.schedule_policy = kv, max_batch_tokens, schedule
        self.eos_token_ids = frozenset(eos_token_ids)
        self.in_batch_threshold = in_batch_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preemption takes from the end
        self.num_steps = 0
        self.report = StepReport(0)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STAT_NAMES, 0)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += req.num_prompt_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- forming a batch ----------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Pick this step's batch: decodes of running requests, then admissions."""
        self.num_steps += 1
        self.report = StepReport(self.num_steps)
        evicted_before = self.kv.evicted_tokens
        decodes = self._schedule_decodes()
        prefills = [] if self.report.preempted else self._admit(self.max_batch_tokens - len(decodes))
        batch = Batch(num_prefills=len(prefills))
        for req in prefills + decodes:
            batch.requests.append(req)
            batch.input_ids.append(req.token_ids[req.num_computed:])
            batch.kv_indices.append(self.kv.kv_indices(req))
        report, kv = self.report, self.kv
        report.decodes = [r.rid for r in decodes]
        report.evicted_tokens = kv.evicted_tokens - evicted_before
        report.used_slots, report.evictable_slots = kv.slots_in_use(self.running), kv.evictable_slots
        report.free_slots = kv.free_slots
        stats = self.stats
        stats["steps"] += 1
        stats["cached_tokens"] += sum(cached for _, cached, _ in report.prefills)
        stats["computed_prefill_tokens"] += sum(computed for _, _, computed in report.prefills)
        stats["evicted_tokens"] += report.evicted_tokens
        stats["preemptions"] += len(report.preempted)
        stats["peak_slots"] = max(stats["peak_slots"], report.used_slots)
        return batch

    def _schedule_decodes(self) -> list[Request]:
        scheduled = []
        for req in list(self.running):
            if req.status != "running":  # preempted earlier in this loop
                break
            while not self.kv.grow(req):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
        return scheduled

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: the request gives its slots back (its computed tokens go to the
        cache, if any) and goes first in line to be prefilled again, outputs included."""
        self.kv.release(req)
        self.running.remove(req)
        req.status = "waiting"
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.report.preempted.append(req.rid)

    def _queue_order(self):
        """Waiting requests with their cached prefix length, in the order to try admitting them."""
        if self.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            pairs = [(req, self.kv.cached_len(req.token_ids)) for req in self.waiting]
            pairs.sort(key=lambda pair: -pair[1])  # stable: ties stay first come, first served
            return pairs
        # fcfs matches lazily: admission usually stops long before the end of the queue.
        return ((req, self.kv.cached_len(req.token_ids)) for req in list(self.waiting))

    def _admit(self, budget: int) -> list[Request]:
        admitted = []
        if not self.waiting:
            return admitted
        # The prompts admitted this step, in a tree of their own (values unused): a request that
        # shares more with them than with the cache would compute that shared part twice.
        in_batch = RadixCache() if self.kv.caches_prefixes and self.in_batch_threshold else None
        for req, cached in self._queue_order():
            extend = len(req.token_ids) - cached
            if extend > budget and (admitted or self.running):
                break  # too big for this step; alone (nothing else to run) it may exceed the budget
            if in_batch is not None:
                shared = len(in_batch.match_prefix(req.token_ids[:-1])) // self.kv.page_size * self.kv.page_size
                if shared - cached >= self.in_batch_threshold:
                    self.report.deferred.append(req.rid)
                    continue
            if not self.kv.admit(req):
                break  # the pool is full; running requests free slots as they finish
            cached = req.num_computed  # what admission actually found
            self.waiting.remove(req)
            req.status = "running"
            self.running.append(req)
            admitted.append(req)
            budget -= len(req.token_ids) - cached
            self.report.prefills.append((req.rid, cached, len(req.token_ids) - cached))
            if in_batch is not None:
                in_batch.insert(req.token_ids, torch.zeros(len(req.token_ids), dtype=torch.int64))
        return admitted

    # --- after the forward ----------------------------------------------------------------------
    def postprocess(self, batch: Batch, next_tokens: list[int]) -> list[Request]:
        """Record each request's sampled token; release and return the requests that finished."""
        finished = []
        self.stats["output_tokens"] += len(batch)
        for i, (req, token) in enumerate(zip(batch.requests, next_tokens)):
            self.kv.after_forward(req, prefilled=i < batch.num_prefills)
            req.token_ids.append(token)
            if token in self.eos_token_ids or len(req.token_ids) - req.num_prompt_tokens >= req.max_new_tokens:
                self.kv.release(req)
                req.status = "finished"
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == "running"]
        self.report.finished = [r.rid for r in finished]
        self.kv.check(self.running)
        return finished
