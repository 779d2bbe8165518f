"""The guards of a learner's prefix caches (kvlearn.parts "radix_cache" and "block_manager"), as the
guarded cache modes (`kvlearn.parts.guarded_kv`) call them; what a guard is: `kvlearn.parts.guard`.
"""

from __future__ import annotations

import torch

from kvlearn.errors import PartError
from kvlearn.parts.guard import Guard, is_int, shown
from kvlearn.pool import KVPool


class RadixGuard(Guard):
    """A learner's radix tree (kvlearn.parts "radix_cache") as `RadixKV` calls it.

    The guard's account, one entry per pool slot: `position[s]` and `token[s]` of the token whose
    KV slot s holds for the tree (-1: the tree does not hold it), set by `insert_prefix` and
    cleared when the tree hands the slot to `evict_callback`; `locks[s]`, the locked paths through s
    (`lock` / `unlock`). Invariants of a correct tree, checked on every answer: a match's slots hold
    the key's tokens at their positions (so they are distinct, the tree's, and no more than the key),
    and `last_node`'s path holds exactly those slots; total_size is the slots held, protected_size
    those on locked paths; evict hands over only unlocked slots it holds, and returns their number.
    """

    name = "radix_cache"

    def __init__(self, part_cls, pool: KVPool):
        self.pool, self.page_size = pool, pool.page_size
        n, device = pool.num_slots, pool.device
        self.position = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.token = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.locks = torch.zeros(n, dtype=torch.int64, device=device)
        self.handed = 0   # slots handed to evict_callback during the current evict
        super().__init__(part_cls(page_size=pool.page_size, evict_callback=self.evicted, device=device))

    # --- the account ----------------------------------------------------------------------------
    def holds(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: does the tree hold each of these slots, by the guard's account?"""
        return self.position[slots] >= 0

    @property
    def num_held(self) -> int:
        return int((self.position >= 0).sum())

    @property
    def num_locked(self) -> int:
        return int((self.locks > 0).sum())

    def path_slots(self, call: str, node) -> torch.Tensor:
        """The slots from the root down to `node` (the nodes' documented `value` and `parent`)."""
        values, steps = [], 0
        while getattr(node, "parent", None) is not None:
            value = getattr(node, "value", None)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
                self.fail(call, f"a node whose value is {shown(value)}", "a node's value is a 1-D int64 tensor of slots")
            values.append(value)
            node, steps = node.parent, steps + 1
            if steps > self.pool.num_slots:
                self.fail(call, "a node whose parents never reach the root", "every node's parent chain ends at the root")
        return torch.cat(values[::-1]).to(self.pool.device) if values else self.position[:0]

    def check_match(self, call: str, key: list, match) -> torch.Tensor:
        """A match's slots (on the pool's device), checked: they hold key[i] at position i, in whole
        pages, and `last_node`'s path holds exactly them."""
        indices = getattr(match, "indices", None)
        if not (isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and indices.dim() == 1):
            self.fail(call, shown(match), "a MatchResult whose indices are a 1-D int64 tensor of slots")
        n, rule = len(indices), "a match's slots hold the key's tokens, in order, in slots the tree holds"
        if n > len(key):
            self.fail(call, f"{shown(indices)} for a key of {len(key)} tokens", "a match is never longer than its key")
        if n % self.page_size:
            self.fail(call, f"{shown(indices)}", f"only whole pages of {self.page_size} tokens are matched")
        slots = indices.to(self.pool.device)
        if n:
            positions, tokens = self.position[slots], self.token[slots]
            want = torch.tensor(key[:n], dtype=torch.int64, device=slots.device)
            wrong = (positions != torch.arange(n, device=slots.device)) | (tokens != want)
            if wrong.any():
                i = int(wrong.nonzero()[0])
                s, earlier = int(slots[i]), (slots[:i] == slots[i]).nonzero()
                why = (f"slot {s} appears twice, at positions {int(earlier[0])} and {i}" if len(earlier) else
                       f"slot {s} at position {i} is not the tree's (never inserted, or evicted)" if positions[i] < 0
                       else f"slot {s} at position {i} holds token {int(tokens[i])} of position "
                            f"{int(positions[i])}, but the key has token {key[i]} there")
                self.fail(call, f"{shown(indices)} for a key of {len(key)} tokens", f"{rule}: {why}")
        path = self.path_slots(call, getattr(match, "last_node", None))
        if not torch.equal(path, slots):
            self.fail(call, f"a last_node whose path holds {shown(path)}, for indices {shown(indices)}",
                      "last_node ends exactly where the match ends: its path holds the match's slots")
        return slots

    # --- what RadixKV calls ---------------------------------------------------------------------
    def match_prefix(self, key: list):
        match = self.part.match_prefix(key)
        self.check_match(f"match_prefix(a key of {len(key)} tokens)", key, match)
        return match

    def match_len(self, key: list) -> int:
        n = self.part.match_len(key)
        return self.check_int(f"match_len(a key of {len(key)} tokens)", n, 0, len(key), "tokens matched")

    def insert_prefix(self, key: list, value: torch.Tensor):
        """The tree keeps its own slots for the `already` tokens it had and takes value[already:]."""
        call = f"insert_prefix(a key of {len(key)} tokens)"
        answer = self.part.insert_prefix(key, value)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            self.fail(call, shown(answer), "insert_prefix returns (length already cached, MatchResult)")
        already, match = answer
        end = len(key) // self.page_size * self.page_size
        self.check_int(call, already, 0, end, "the length already cached")
        new = value[already:end].to(self.pool.device)
        self.position[new] = torch.arange(already, end, device=new.device)
        self.token[new] = torch.tensor(key[already:end], dtype=torch.int64, device=new.device)
        slots = self.check_match(call, key, match)
        if not torch.equal(slots, value[:len(slots)].to(slots.device)) or len(slots) != end:
            self.fail(call, f"a match of {shown(match.indices)}", f"after insert the whole key matches ({end} tokens), "
                      "in the tree's slots for what it had and the given ones for the rest")
        return already, match

    def lock(self, node) -> None:
        path = self.path_slots("lock", node)
        self.part.lock(node)
        self.locks[path] += 1

    def unlock(self, node) -> None:
        path = self.path_slots("unlock", node)
        self.part.unlock(node)
        if (self.locks[path] <= 0).any():
            self.fail("unlock", f"a node whose path holds {shown(path)}",
                      "a locked path keeps its slots until it is unlocked (this one changed)")
        self.locks[path] -= 1

    def unlocked_on_path(self, node) -> int:
        path = self.path_slots("unlocked_on_path", node)
        own = int((self.locks[path] == 0).sum())
        n = self.part.unlocked_on_path(node)
        if n != own or not is_int(n):
            self.fail("unlocked_on_path", shown(n), f"the tokens in unlocked nodes from the node up to the root: {own}")
        return n

    def evicted(self, slots) -> None:
        """The tree's `evict_callback`: only unlocked slots the tree holds, each once, go back to the pool."""
        call, rule = "evict (its evict_callback)", "evict hands over the slots of unlocked leaves it holds, once each"
        if not (isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.dim() == 1):
            self.fail(call, shown(slots), f"{rule}, as a node's value (1-D int64)")
        slots = slots.to(self.pool.device)
        if not self.holds(slots).all():
            self.fail(call, shown(slots), f"{rule}: slot {int(slots[~self.holds(slots)][0])} is not the tree's")
        if slots.unique().numel() != slots.numel():
            self.fail(call, shown(slots), f"{rule}: a slot appears twice")
        if (self.locks[slots] > 0).any():
            self.fail(call, shown(slots), f"{rule}: slot {int(slots[self.locks[slots] > 0][0])} is on a locked path")
        self.pool.free(slots)   # first: if the pool refuses, the tree still holds them
        self.position[slots] = -1
        self.token[slots] = -1
        self.handed += len(slots)

    def evict(self, num_tokens: int) -> int:
        self.handed, evictable = 0, self.num_held - self.num_locked
        freed = self.part.evict(num_tokens)
        self.raise_swallowed()
        call = f"evict({num_tokens})"
        if freed != self.handed or not is_int(freed):
            self.fail(call, shown(freed), f"evict returns the tokens it handed to evict_callback ({self.handed})")
        if freed < min(num_tokens, evictable):
            self.fail(call, shown(freed), f"evict frees at least num_tokens, or every evictable token ({evictable})")
        return freed

    def size(self, name: str, own: int, what: str) -> int:
        n = getattr(self.part, name)
        if n != own or not is_int(n):
            self.fail(name, shown(n), f"it counts the tokens {what}: {own} by the engine's account")
        return n

    @property
    def evictable_size(self) -> int:
        return self.size("evictable_size", self.num_held - self.num_locked, "in unlocked nodes")

    @property
    def protected_size(self) -> int:
        return self.size("protected_size", self.num_locked, "on locked paths")

    @property
    def total_size(self) -> int:
        return self.size("total_size", self.num_held, "the tree holds")

    def drop_all(self) -> None:
        """After a PartError, with no request holding KV: empty the tree (its `reset`), give every
        slot it held back to the pool, and trust it again from empty."""
        self.part.reset()
        held = self.holds(torch.arange(self.pool.num_slots, device=self.pool.device)).nonzero().reshape(-1)
        self.pool.free(held)
        self.position.fill_(-1)
        self.token.fill_(-1)
        self.locks.zero_()
        self.broken, self.error = False, None


def _prefix_keys(token_ids: list[int], block_size: int, num_blocks: int) -> list[int]:
    """For each of the first `num_blocks` full blocks, a key of the whole prefix up to its end."""
    keys, key = [], None
    for i in range(num_blocks):
        key = hash((key, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        keys.append(key)
    return keys


class BlockManagerGuard(Guard):
    """A learner's block manager (kvlearn.parts "block_manager") as `BlockKV` calls it.

    The guard's account: `tables` (each live sequence's table as last checked), `holders[b]` (the
    live tables holding block b) and `content[b]` (the prefix, by a key of its tokens, whose KV
    block b holds once computed). Invariants of a correct manager, checked on every answer: a table
    has one block per logical block, in range, distinct; its cached head holds blocks whose KV is
    that very prefix, the rest blocks no other live table holds (owned by that sequence); a
    deallocated table is empty; the blocks in use are exactly the blocks of live tables.
    """

    name = "block_manager"

    def __init__(self, part_cls, pool: KVPool):
        self.part_cls, self.pool = part_cls, pool
        self.block_size, self.num_blocks = pool.page_size, pool.num_slots // pool.page_size
        super().__init__(self.new_part())
        self.forget()

    def new_part(self):
        return self.part_cls(self.num_blocks, self.block_size, enable_prefix_caching=True,
                             allocator=self.pool.allocator)

    def forget(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.holders = [0] * self.num_blocks
        self.content: dict[int, int] = {}
        self.num_used = 0

    # --- checks -----------------------------------------------------------------------------------
    def check_table(self, call: str, seq, before: list[int]) -> list[int]:
        """`seq`'s table after `call`: it extends `before`, and its new blocks are this sequence's."""
        table, size = seq.block_table, self.block_size
        need = -(-len(seq.token_ids) // size)
        rule = f"a table holds one block per {size} tokens ({need} here)"
        if not isinstance(table, list) or len(table) != need or table[:len(before)] != before:
            self.fail(call, f"block_table {shown(table)}", f"{rule}, and keeps the blocks it had")
        bad = [b for b in table if not is_int(b) or not 0 <= b < self.num_blocks]
        if bad or len(set(table)) != len(table):
            self.fail(call, f"block_table {shown(table)}", f"{rule}: distinct block ids in 0 .. {self.num_blocks - 1}")
        return table

    def take(self, call: str, seq, table: list[int], start: int) -> None:
        """Record `seq`'s table, `table[start:]` new blocks (no other live table may hold one)."""
        shared = [b for b in table[start:] if self.holders[b]]
        if shared:
            self.fail(call, f"block_table {shown(table)}", f"a new block belongs to that sequence alone: block "
                      f"{shared[0]} is in another live table")
        for b in table[start:]:
            self.content.pop(b, None)   # its KV is about to be written anew
        self.hold(table[start:] if seq.seq_id in self.tables else table, 1)
        self.tables[seq.seq_id] = list(table)

    def hold(self, blocks: list[int], step: int) -> None:
        """`step` more (or fewer) live tables hold each of `blocks`."""
        for b in blocks:
            before = self.holders[b]
            self.holders[b] += step
            self.num_used += (self.holders[b] > 0) - (before > 0)

    # --- what BlockKV calls -----------------------------------------------------------------------
    def can_allocate(self, seq) -> bool:
        return self.answer_bool("can_allocate", self.part.can_allocate(seq))

    def can_append(self, seq) -> bool:
        return self.answer_bool("can_append", self.part.can_append(seq))

    def answer_bool(self, call: str, value) -> bool:
        if not isinstance(value, bool):
            self.fail(call, shown(value), "a query that answers True or False")
        return value

    def allocate(self, seq) -> None:
        call = f"allocate(a sequence of {len(seq.token_ids)} tokens)"
        self.part.allocate(seq)
        try:
            table = self.check_table(call, seq, [])
            cached = self.check_int(call, seq.num_cached_tokens, 0, len(seq.token_ids) - 1,
                                    "num_cached_tokens (never the last token)")
            if cached % self.block_size:
                self.fail(call, f"num_cached_tokens {cached}", f"the cached head is whole blocks of {self.block_size}")
            hits = cached // self.block_size
            for i, key in enumerate(_prefix_keys(seq.token_ids, self.block_size, hits)):
                if self.content.get(table[i]) != key:
                    self.fail(call, f"block_table {shown(table)} with {cached} cached tokens", f"a cached block "
                              f"holds the KV of that very prefix: block {table[i]} (logical block {i}) does not")
            self.take(call, seq, table, hits)
        except PartError:   # the sequence stays unallocated (it waits); the part is dropped (drop_all)
            seq.block_table, seq.num_cached_tokens = [], 0
            raise

    def may_append(self, seq) -> None:
        call = f"may_append(a sequence of {len(seq.token_ids)} tokens)"
        before = self.tables[seq.seq_id]
        self.part.may_append(seq)
        table = self.check_table(call, seq, before)
        self.take(call, seq, table, len(before))

    def hash_blocks(self, seq):
        """After the forward: every full block of `seq` holds its prefix's KV now."""
        published = self.part.hash_blocks(seq)
        full = min(len(seq.token_ids) // self.block_size, len(seq.block_table))
        for b, key in zip(seq.block_table, _prefix_keys(seq.token_ids, self.block_size, full)):
            self.content[b] = key
        return published

    def deallocate(self, seq) -> None:
        self.part.deallocate(seq)
        if seq.block_table:
            self.fail("deallocate", f"block_table {shown(seq.block_table)}", "deallocate empties the sequence's table")
        self.hold(self.tables.pop(seq.seq_id), -1)

    def num_cached_prefix(self, token_ids) -> int:
        n = self.part.num_cached_prefix(token_ids)
        return self.check_int("num_cached_prefix", n, 0, len(token_ids), "tokens allocate would take from the cache")

    @property
    def num_free_blocks(self) -> int:
        n, own = self.part.num_free_blocks, self.num_blocks - self.num_used
        if n != own or not is_int(n):
            self.fail("num_free_blocks", shown(n), f"the blocks no live table holds: {own} by the engine's account")
        return n

    @property
    def num_cached_free_blocks(self) -> int:
        n = self.part.num_cached_free_blocks
        return self.check_int("num_cached_free_blocks", n, 0, self.num_blocks - self.num_used,
                              "blocks nobody uses whose prefix can still be hit")

    def evict_cached(self) -> int:
        n = self.part.evict_cached()
        return self.check_int("evict_cached", n, 0, self.pool.num_slots, "tokens forgotten")

    @property
    def stats(self):
        return self.part.stats

    def drop_all(self) -> None:
        """After a PartError, with no table live: every used page goes back to the pool, and a fresh
        manager of the learner's class takes over."""
        pages = torch.arange(self.num_blocks, dtype=torch.int64, device=self.pool.device)
        used = pages[~self.pool.allocator.is_free(pages)]
        self.pool.free(self.pool.slots_of(used))
        self.part = self.new_part()
        self.forget()
        self.broken, self.error = False, None
