"""Trust but verify: how a learner's part serves in the engine (`GUARDS`, read by chapter 6's hook).

A part serves behind thin checks at its boundary: the types, lengths and ranges of its answers, and
the ownership of the slots it hands out (a page handed out is not held; a match's slots are distinct
and the tree's; a new block is in no other live table). After every step the engine's own
invariants run (`KVManager.check`). The first violation raises `kvlearn.PartError`, naming the
part, the call and the rule, and the engine stops: a wrong part never serves wrong tokens silently.
The package's own parts serve as they are. Checks are code, not `assert` (`python -O` keeps them).
"""

from __future__ import annotations

from functools import partial

import torch

from kvlearn.device import resolve_device
from kvlearn.errors import KVCapacityError, PartError
from kvlearn.kernels import stage1_attention
from kvlearn.parts.conformance import SUITES, checked
from kvlearn.parts.judge import shown
from kvlearn.parts.suite_quantizer import HINTS, answer_problem
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import BlockKV, RadixKV
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS


class Guard:
    """A learner's part behind checks: members it does not check are the part's own (`__getattr__`)."""

    name: str   # the part's name ("radix_cache", ...)

    def __init__(self, part):
        self.part = part

    def __getattr__(self, member: str):
        if "part" not in self.__dict__:
            raise AttributeError(member)
        return getattr(self.__dict__["part"], member)

    def fail(self, call: str, returned: str, rule: str):
        raise PartError(self.name, self.part, call, returned, rule)

    def integer(self, call: str, value, low: int, high: int, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(call, shown(value), f"{what}: an int in {low} .. {high}")
        return value

    def slots(self, call: str, value, n: int | None, limit: int, what: str) -> torch.Tensor:
        """`value` checked: a 1-D int64 tensor (of `n` items, if given) of distinct ids in 0 .. limit - 1."""
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 1
                and n in (None, value.numel())):
            self.fail(call, shown(value), f"{what}: a 1-D int64 tensor" + (f" of {n} ids" if n is not None else ""))
        if value.numel() and not ((value >= 0) & (value < limit)).all():
            self.fail(call, shown(value), f"{what}: ids in 0 .. {limit - 1}")
        ordered, where = value.sort(stable=True)
        twice = (ordered[1:] == ordered[:-1]).nonzero()
        if len(twice):
            i = int(twice[0])
            first, second = sorted((int(where[i]), int(where[i + 1])))
            self.fail(call, shown(value), f"{what}, each once: {int(ordered[i])} appears twice, at positions "
                                          f"{first} and {second}")
        return value


class AllocatorGuard(Guard):
    """A learner's page allocator, built as the pool builds one. Ownership: `held[p]` while page p is
    handed out; `alloc` hands out only pages nobody holds; `held` answers `num_free` and `is_free`."""

    name = "allocator"

    def __init__(self, part_cls, num_pages: int, device=None):
        self.num_pages, self.device = num_pages, resolve_device(device)
        super().__init__(part_cls(num_pages, device=self.device))
        self.held = torch.zeros(num_pages, dtype=torch.bool, device=self.device)

    @property
    def num_free(self) -> int:
        return self.num_pages - int(self.held.sum())

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        return ~self.held[pages.to(self.device)]

    def alloc(self, n: int) -> torch.Tensor:
        call = f"alloc({n})"
        try:
            pages = self.part.alloc(n)
        except KVCapacityError as err:   # the pool asks only for pages its account says are free
            self.fail(call, f"KVCapacityError ({err})", f"{self.num_free} of its {self.num_pages} pages are free, so "
                                                        f"alloc({n}) must succeed")
        pages = self.slots(call, pages, n, self.num_pages, "alloc(n) returns n pages").to(self.device)
        if self.held[pages].any():
            page = int(pages[self.held[pages]][0])
            self.fail(call, f"pages {shown(pages)}", f"a page is handed out at most once until it is freed: page "
                                                     f"{page} is held (handed out before and not freed since)")
        self.held[pages] = True
        return pages

    def free(self, pages: torch.Tensor) -> None:
        pages = pages.to(self.device)
        if not self.held[pages].all():
            bad = pages[~self.held[pages]][:5].tolist()
            raise ValueError(f"Double free: page(s) {bad} are free by the pool's account; free only what alloc "
                             "handed out.")
        self.part.free(pages)
        self.held[pages] = False


def guard_attention(fn, name: str = "attention", label: str | None = None):
    """A learner's attention function with its output checked in every layer: [T, heads, head_dim]
    like the query, the query's dtype and device, finite; a `PartError` names part `name` (`label`)."""
    label = label or getattr(fn, "__qualname__", type(fn).__name__)

    def guarded(query, key, value, layer, kv_pool, md, scale=None):
        out = fn(query, key, value, layer, kv_pool, md, scale)
        call = f"attention(layer {layer}, {query.shape[0]} tokens)"
        if not (isinstance(out, torch.Tensor) and out.shape == query.shape and out.dtype == query.dtype
                and out.device == query.device):
            raise PartError(name, label, call, shown(out), f"it returns [T, heads, head_dim] = "
                            f"{list(query.shape)} of {query.dtype} on {query.device}, like the query")
        if not torch.isfinite(out).all():
            said = "NaN in its output" if torch.isnan(out).any() else "inf in its output"
            raise PartError(name, label, call, said, "attention of finite inputs is finite")
        return out

    guarded.__qualname__ = label
    return guarded


class RadixGuard(Guard):
    """A learner's radix tree as `RadixKV` calls it. Ownership: `held[s]` while the tree holds slot s
    (given by `insert_prefix`, handed back through `evict_callback`); a match's slots are held."""

    name = "radix_cache"

    def __init__(self, part_cls, pool: KVPool):
        self.pool, self.page_size = pool, pool.page_size
        self.held = torch.zeros(pool.num_slots, dtype=torch.bool, device=pool.device)
        self.handed = 0   # slots handed to evict_callback in the current evict
        super().__init__(part_cls(page_size=pool.page_size, evict_callback=self.evicted, device=pool.device))

    def match(self, call: str, key: list, match) -> torch.Tensor:
        indices = self.slots(call, getattr(match, "indices", None), None, self.pool.num_slots, "a match's slots")
        if len(indices) > len(key):
            self.fail(call, f"{shown(indices)} for a key of {len(key)} tokens", "a match is never longer than its key")
        if len(indices) % self.page_size:
            self.fail(call, shown(indices), f"only whole pages of {self.page_size} tokens are matched")
        if not self.held[indices].all():
            stray = int(indices[~self.held[indices]][0])
            self.fail(call, shown(indices), f"a match's slots are the tree's: slot {stray} is not (evicted?)")
        return indices

    def match_prefix(self, key: list):
        match = self.part.match_prefix(key)
        self.match(f"match_prefix(a key of {len(key)} tokens)", key, match)
        return match

    def insert_prefix(self, key: list, value: torch.Tensor):
        """The tree keeps its own slots for the `already` tokens it had and takes value[already:end]."""
        call, end = f"insert_prefix(a key of {len(key)} tokens)", len(key) // self.page_size * self.page_size
        answer = self.part.insert_prefix(key, value)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            self.fail(call, shown(answer), "insert_prefix returns (length already cached, MatchResult)")
        already = self.integer(call, answer[0], 0, end, "the length already cached")
        self.held[value[already:end].to(self.held.device)] = True
        indices = self.match(call, key, answer[1])
        if len(indices) != end or not torch.equal(indices[already:], value[already:end].to(indices.device)):
            self.fail(call, f"a match of {shown(indices)}", f"after insert the whole key matches ({end} tokens), in "
                      "the tree's slots for what it had and the given ones for the rest")
        return answer

    def evicted(self, slots) -> None:
        """The tree's `evict_callback`: slots it holds, each once, go back to the pool."""
        slots = self.slots("evict (its evict_callback)", slots, None, self.pool.num_slots, "a node's slots")
        if not self.held[slots].all():
            self.fail("evict (its evict_callback)", shown(slots), "evict hands over only slots the tree holds")
        self.pool.free(slots)
        self.held[slots] = False
        self.handed += len(slots)

    def evict(self, num_tokens: int) -> int:
        self.handed = 0
        freed = self.part.evict(num_tokens)
        if freed != self.handed:
            self.fail(f"evict({num_tokens})", shown(freed), f"it returns the tokens it evicted ({self.handed})")
        return freed


class BlockManagerGuard(Guard):
    """A learner's block manager as `BlockKV` calls it. Ownership: `tables`, each live sequence's
    table; a table has one distinct block in range per logical block, and its new blocks (after
    the cached head) are in no other live table."""

    name = "block_manager"

    def __init__(self, part_cls, pool: KVPool):
        self.block_size, self.count = pool.page_size, pool.num_slots // pool.page_size
        super().__init__(part_cls(self.count, self.block_size, enable_prefix_caching=True, allocator=pool.allocator))
        self.tables: dict[int, list[int]] = {}

    def table(self, call: str, seq, keep: int) -> None:
        """Record `seq`'s table after `call`: right length, distinct ids in range, `keep` blocks as
        they were, the others in no other live table."""
        table, before = seq.block_table, self.tables.get(seq.seq_id, [])
        need = -(-len(seq.token_ids) // self.block_size)
        if not (isinstance(table, list) and len(table) == need and all(isinstance(b, int) for b in table)):
            self.fail(call, f"block_table {shown(table)}", f"a table holds one block id per {self.block_size} "
                                                           f"tokens ({need} here)")
        self.slots(call, torch.tensor(table, dtype=torch.int64), need, self.count, "a table's blocks")
        if table[:len(before)] != before:
            self.fail(call, f"block_table {shown(table)}", f"may_append keeps the blocks a table had: {shown(before)}")
        others = {b for sid, t in self.tables.items() if sid != seq.seq_id for b in t}
        shared = [b for b in table[keep:] if b in others]
        if shared:
            self.fail(call, f"block_table {shown(table)}", f"a new block belongs to its sequence alone: block "
                                                           f"{shared[0]} is in another live table")
        self.tables[seq.seq_id] = list(table)

    def allocate(self, seq) -> None:
        call = f"allocate(a sequence of {len(seq.token_ids)} tokens)"
        self.part.allocate(seq)
        cached = self.integer(call, seq.num_cached_tokens, 0, len(seq.token_ids) - 1, "num_cached_tokens (never "
                                                                                        "the last token)")
        if cached % self.block_size:
            self.fail(call, f"num_cached_tokens {cached}", f"the cached head is whole blocks of {self.block_size}")
        self.table(call, seq, cached // self.block_size)

    def may_append(self, seq) -> None:
        self.part.may_append(seq)
        self.table(f"may_append(a sequence of {len(seq.token_ids)} tokens)", seq, len(self.tables[seq.seq_id]))

    def deallocate(self, seq) -> None:
        self.part.deallocate(seq)
        if seq.block_table:
            self.fail("deallocate", f"block_table {shown(seq.block_table)}", "deallocate empties the sequence's table")
        self.tables.pop(seq.seq_id)


class Guarded:
    """What the guarded cache modes share: their cache is a learner's part behind `guard`."""

    @property
    def cache(self):
        return self.guard.part

    def foreign_parts(self) -> list[tuple[str, object]]:
        return super().foreign_parts() + [(self.guard.name, self.guard.part)]


class GuardedRadixKV(Guarded, RadixKV):
    """`RadixKV` over a learner's tree class, behind a `RadixGuard`."""

    def __init__(self, radix_cache, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.tree = self.guard = RadixGuard(radix_cache, pool)


class GuardedBlockKV(Guarded, BlockKV):
    """`BlockKV` over a learner's block manager class, behind a `BlockManagerGuard`."""

    def __init__(self, block_manager, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.manager = self.guard = BlockManagerGuard(block_manager, pool)


class QuantizerGuard(Guard):
    """A learner's int8 quantizer as the pool's format (chapter 10): the "int8" format's bytes, its answers checked."""

    name = "quantizer"

    def __init__(self, part_cls, dtype: torch.dtype, head_dim: int):   # built as a format is (dtype: the model's)
        super().__init__(part_cls(head_dim))
        self.layout = SUITES["quantizer"].package(head_dim)   # the "int8" format: head_dim codes, the scale's bytes
        self.dtype, self.row = self.layout.dtype, self.layout.row

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        call, got = f"quantize(rows of shape {list(x.shape)})", self.part.quantize(x)
        if problem := answer_problem(x, got):   # (what came back, the rule it breaks)
            self.fail(call, problem[0], HINTS[problem[1]])
        if not (torch.isfinite(got[1]) & (got[1] >= 0)).all():
            self.fail(call, "a scale that is NaN, inf or < 0", "a scale is finite and >= 0 (its row's absmax / 127)")
        return self.layout.pack(*got)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out, shape = self.part.dequantize(*self.layout.unpack(rows), dtype), (*rows.shape[:-1], self.layout.head_dim)
        if not (isinstance(out, torch.Tensor) and (out.shape, out.dtype) == (shape, dtype) and out.isfinite().all()):
            self.fail(f"dequantize(codes of shape {list(shape)}, scale, {dtype})", shown(out),
                      f"{HINTS['dtype']} (finite)")
        return out


GUARDS = {
    "allocator": lambda part: partial(AllocatorGuard, checked("allocator", part)),
    "attention": lambda part: guard_attention(checked("attention", part)),
    "decode_kernel": lambda kernel: guard_attention(stage1_attention(kernel), "decode_kernel", kernel.__name__),
    "radix_cache": lambda part: partial(GuardedRadixKV, checked("radix_cache", part)),
    "block_manager": lambda part: partial(GuardedBlockKV, checked("block_manager", part)),
    "scheduler": lambda part: checked("scheduler", part),
    "quantizer": lambda part: partial(QuantizerGuard, checked("quantizer", part)),
}
