"""Brute-force references of the stateful parts (radix cache, block manager): no nodes, heaps or hashes.

Each keeps the state a chapter's structure stands for as plain Python data (dicts of token prefixes,
lists of free pages) and says what every call must return. Where the chapter leaves a choice open
(where in a block table the new blocks go, which leaf a radix cache evicts among equally old ones),
the reference takes the part's choice once it has checked it is an allowed one, and goes on from
there. Used by `kvlearn.parts.check` and by tests/test_*_state_machine.py. The stateless parts'
references live in their suites (`suite_attention.attention_reference`, `suite_quantizer.int8_row`).
"""
from __future__ import annotations

from collections import Counter


class RadixReference:
    """A radix cache as a dict: every cached page-aligned prefix (a tuple of tokens) -> the slots of
    its last page, the logical time a match or insert last walked over it, and its hits.

    The clock ticks once per match or insert. A lock covers every prefix of the locked prefix.
    Eviction takes an unlocked leaf (a prefix that no other prefix extends) with the smallest key:
    its time under "lru", (hits, time) under "lfu", and with it the rest of its node.

    The tree's shape is kept as `ends`, the prefixes where a node ends: where a match stopped (the
    tree splits an edge there) and where an insert ended; nowhere else. A node holds the pages
    after the nearest shorter end up to its own; evicting a leaf takes all of them at once.
    """

    def __init__(self, page_size: int = 1, policy: str = "lru"):
        self.page, self.policy = page_size, policy
        self.slot: dict[tuple, tuple] = {}
        self.time: dict[tuple, int] = {}
        self.hits: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list[tuple] = []   # one locked prefix per lock held
        self.ends: set[tuple] = set()  # the prefixes where a node of the tree ends

    # --- queries ---------------------------------------------------------------------------------
    def aligned(self, key: tuple) -> tuple:
        return key[:len(key) // self.page * self.page]

    def cached_length(self, key: tuple) -> int:
        n = 0
        while n + self.page <= len(key) and key[:n + self.page] in self.slot:
            n += self.page
        return n

    def slots_of(self, key: tuple, n: int) -> list[int]:
        """Slots of the first `n` (cached) tokens of `key`."""
        return [s for j in range(self.page, n + 1, self.page) for s in self.slot[key[:j]]]

    def locked(self, prefix: tuple) -> bool:
        return any(lp[:len(prefix)] == prefix for lp in self.locks)

    @property
    def total_size(self) -> int:
        return self.page * len(self.slot)

    @property
    def protected_size(self) -> int:
        return self.page * sum(self.locked(p) for p in self.slot)

    @property
    def evictable_size(self) -> int:
        return self.total_size - self.protected_size

    def evict_key(self, prefix: tuple):
        return self.time[prefix] if self.policy == "lru" else (self.hits[prefix], self.time[prefix])

    def unlocked_leaves(self) -> list[tuple]:
        parents = {p[:-self.page] for p in self.slot}
        return [p for p in self.slot if p not in parents and not self.locked(p)]

    def node_start(self, end: tuple) -> tuple:
        """Where the node ending at `end` starts: the longest shorter end on its path (or the root)."""
        return max((e for e in self.ends if len(e) < len(end) and end[:len(e)] == e), key=len, default=())

    # --- mutations -------------------------------------------------------------------------------
    def _touch(self, key: tuple, n: int) -> None:
        for j in range(self.page, n + 1, self.page):
            self.time[key[:j]] = self.clock

    def match(self, key: tuple) -> tuple[int, list[int]]:
        """`match_prefix(key)`: the matched length and its slots."""
        key = tuple(key)
        n = self.cached_length(key)
        self.clock += 1
        self._touch(key, n)
        if n:
            self.ends.add(key[:n])
        for j in range(self.page, n + 1, self.page):
            self.hits[key[:j]] += 1
        return n, self.slots_of(key, n)

    def insert(self, key: tuple, value: list[int]) -> tuple[int, list[int]]:
        """`insert(key, value)`: the length already cached, and the tree's slots for the whole
        aligned key afterwards (what `insert_prefix`'s match holds)."""
        key = tuple(key)
        present, aligned = self.cached_length(key), self.aligned(key)
        self.clock += 1
        for j in range(present + self.page, len(aligned) + 1, self.page):
            self.slot[key[:j]] = tuple(value[j - self.page:j])
            self.hits[key[:j]] = 0
        self.ends.update(end for end in (key[:present], aligned) if end)
        self._touch(key, len(aligned))
        return present, self.slots_of(key, len(aligned))

    def lock(self, prefix: tuple) -> None:
        self.locks.append(tuple(prefix))

    def unlock(self, prefix: tuple) -> None:
        self.locks.remove(tuple(prefix))

    def evicted(self, slots: list[int]) -> str | None:
        """One `evict_callback(slots)`: drop the leaf that held them; the reason it may not be
        evicted (not a whole leaf, locked, not the least recently used), or None."""
        victims = [p for p, s in self.slot.items() if set(s) & set(slots)]
        if not victims or sorted(s for p in victims for s in self.slot[p]) != sorted(slots):
            return f"the callback got slots {slots}, which are not the slots of one cached node"
        last = max(victims, key=len)
        if last in {p[:-self.page] for p in self.slot}:
            return f"it evicted a node that still has children (tokens {list(last)})"
        if self.locked(last):
            return f"it evicted a locked node (tokens {list(last)})"
        if self.evict_key(last) > min(map(self.evict_key, self.unlocked_leaves())):
            return f"it evicted tokens {list(last)} while a leaf used less recently was unlocked"
        start = self.node_start(last)
        if last not in self.ends or len(victims) * self.page != len(last) - len(start):
            first = len(last) - len(victims) * self.page
            return (f"it evicted tokens {list(last[first:])} of the node that holds tokens {list(last[len(start):])} "
                    f"(after {list(start)}): a leaf leaves the tree whole")
        for p in victims:
            del self.slot[p], self.time[p], self.hits[p]
        self.ends.discard(last)
        return None


class BlockReference:
    """A block manager without hashes: the allocator's free pages (in the order it hands them out),
    the cached blocks (in the order they are reused, and when each was freed), which block holds the
    published copy of which token prefix, the live tables, and the prefix-cache counters.

    A block is published by the first `hash_blocks` that finds it full and computed, unless another
    block already holds its prefix: then it stays a copy for good, never published. New blocks are
    free pages first (those the allocator hands out), then cached blocks, least recently freed
    first; one `deallocate` caches its blocks from the table's last to its first (so the head of a
    prefix is reused last) and gives the others back to the allocator in table order, the first
    handed out first next time (the allocator is a stack). A mutation that breaks a rule says which:
    a (rule, what happened) pair, the rule a key of the suites' hints.

    With `hash_fn` (the part's `hash_fn(parent_hash, token_ids)`, one that collides), a prefix is
    published under its chained hash, not its tokens: two prefixes with one hash have one published
    copy, and a hit needs the block's own tokens to equal the sequence's too (the collision guard).
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True, hash_fn=None):
        self.num_blocks, self.bs, self.caching, self.hash_fn = num_blocks, block_size, caching, hash_fn
        self.free = list(range(num_blocks))  # the allocator's free pages, the next one handed out first
        self.cached: dict[int, int] = {}     # cached block nobody uses -> when it was freed; reuse order
        self.held: dict[int, tuple] = {}     # published block -> the token prefix its KV completes
        self.hashed: dict[int, tuple] = {}   # published blocks and their copies -> the prefix each completes
        self.tables: dict[int, list[int]] = {}  # seq_id -> block table of a live sequence
        self.clock = 0
        self.evicted_blocks = 0
        self.collided = False
        self.counters = (0, 0, 0, 0)         # allocate's stats: queries, query_tokens, hit_blocks, hit_tokens

    # --- queries ---------------------------------------------------------------------------------
    def refs(self) -> Counter:
        return Counter(b for table in self.tables.values() for b in table)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    def key(self, prefix) -> tuple | int:
        """What a block-aligned prefix is published under: its tokens, or with `hash_fn` its chained hash."""
        if self.hash_fn is None:
            return tuple(prefix)
        h = None
        for j in range(0, len(prefix), self.bs):
            h = self.hash_fn(h, list(prefix[j:j + self.bs]))
        return h

    def hit(self, tokens: list[int]) -> list[int]:
        """Blocks of the longest published prefix of `tokens`, never its last token; a published key
        whose block holds other tokens (a collision: `collided` says the walk ended at one) is a miss."""
        if not self.caching:
            return []
        findable = {self.key(prefix): b for b, prefix in self.held.items()}
        hit, self.collided = [], False
        for j in range((len(tokens) - 1) // self.bs):
            b = findable.get(self.key(tokens[:(j + 1) * self.bs]))
            self.collided = b is not None and self.held[b][-self.bs:] != tuple(tokens[j * self.bs:(j + 1) * self.bs])
            if b is None or self.collided:
                break
            hit.append(b)
        return hit

    def blocks_needed(self, num_tokens: int, hit: list[int]) -> int:
        refs = self.refs()
        return -(-num_tokens // self.bs) - sum(refs[b] > 0 for b in hit)

    def copied(self, tokens: list[int]) -> bool:
        """Whether a block-aligned prefix of `tokens` is published under a key that a copy also holds."""
        keys = [self.key(prefix) for prefix in self.hashed.values()]
        return any(keys.count(self.key(tokens[:j])) > 1 for j in range(self.bs, len(tokens), self.bs))

    def same_key(self, a: int, b: int) -> bool:
        """Whether hashed blocks `a` and `b` are published under one key (one is a copy of the other)."""
        return a in self.hashed and b in self.hashed and self.key(self.hashed[a]) == self.key(self.hashed[b])

    # --- mutations -------------------------------------------------------------------------------
    def take(self, new: list[int]) -> tuple[str, str] | None:
        """The part gave these blocks for new KV (`allocate` and `append` call it): the rule it broke,
        or None (and they are taken)."""
        if len(set(new)) != len(new):
            return "take", f"it handed out block(s) {sorted(b for b, k in Counter(new).items() if k > 1)} twice"
        busy = [b for b in new if b not in self.free and b not in self.cached]
        if busy:
            return "take", f"it handed out block(s) {busy}, which are in use (or do not exist)"
        from_cached = [b for b in new if b in self.cached]
        if len(new) - len(from_cached) != min(len(new), len(self.free)):
            return "take", (f"it reused cached block(s) {from_cached} while the allocator still had free pages "
                            f"{sorted(self.free)}")
        due = list(self.cached)[:len(from_cached)]
        if set(from_cached) != set(due):
            skipped = next(b for b in due if b not in from_cached)
            return "take", (f"it reused cached block(s) {from_cached} before block {skipped}, which was freed "
                            "earlier (one deallocate frees its table from the last block to the first)")
        for b in new:
            if b in self.free:
                self.free.remove(b)
            else:
                del self.cached[b]
                self.forget(b)
                self.evicted_blocks += 1
        return None

    def forget(self, b: int) -> None:
        self.held.pop(b, None)
        self.hashed.pop(b, None)

    def allocate(self, seq_id: int, hit: list[int], new: list[int], num_tokens: int) -> tuple[str, str] | None:
        """`allocate` gave the sequence of `num_tokens` tokens the `hit` blocks, then `new` ones: the
        rule it broke, or None (and the counters count it)."""
        shared = [b for b in new if b in hit]
        if shared:
            return "share", f"it handed out block(s) {shared} for new KV, which are in use: the sequence shares them"
        for b in hit:   # hits are taken before any new block, so no hit is reused for new KV
            self.cached.pop(b, None)
        self.tables[seq_id] = list(hit) + list(new)
        if self.caching:
            queries, tokens, blocks, hit_tokens = self.counters
            self.counters = (queries + 1, tokens + num_tokens, blocks + len(hit), hit_tokens + len(hit) * self.bs)
        return self.take(new)

    def append(self, seq_id: int, table: list[int]) -> tuple[str, str] | None:
        """`may_append` grew the sequence's table to `table`: the rule it broke, or None."""
        new = table[len(self.tables[seq_id]):]
        self.tables[seq_id] = list(table)
        return self.take(new)

    def publish(self, seq_id: int, tokens: list[int], num_computed: int) -> int:
        """`hash_blocks`: returns how many blocks were hashed now (published or copies)."""
        if not self.caching:
            return 0
        table, new = self.tables[seq_id], 0
        for j in range(num_computed // self.bs):
            b = table[j]
            if b not in self.hashed:
                prefix = tuple(tokens[:(j + 1) * self.bs])
                if self.key(prefix) not in {self.key(p) for p in self.held.values()}:
                    self.held[b] = prefix
                self.hashed[b] = prefix
                new += 1
        return new

    def release(self, seq_id: int) -> None:
        """`deallocate`: blocks nobody holds any more are cached if published (the table's last
        block first), else given back to the allocator (in table order, the first on top)."""
        table = self.tables.pop(seq_id)
        refs = self.refs()
        self.clock += 1
        last_user = [b for b in table if not refs[b]]
        released = [b for b in last_user if b not in self.held]
        for b in reversed(last_user):
            if b in self.held:
                self.cached[b] = self.clock
        for b in released:
            self.forget(b)
        self.free = released + self.free

    def evict_cached(self) -> int:
        """`evict_cached`: every cached block goes back to the allocator, the first to be reused on top."""
        for b in self.cached:
            self.forget(b)
        self.free = list(self.cached) + self.free
        self.evicted_blocks += len(self.cached)
        n, self.cached = len(self.cached) * self.bs, {}
        return n
