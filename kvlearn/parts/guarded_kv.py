"""How a learner's part serves in the engine: `GUARDS`, the table chapter 6's hook reads
(`kvlearn.serving.part_registry.served`; `kvlearn/__init__` registers it), and the guarded cache modes.

For each part name, `GUARDS[name](part)` checks that the part has every member of its contract
(`checked`: TypeError naming what it lacks) and returns what serves in its place, behind a guard
(kvlearn.parts.guard): for "allocator" a class the pool builds, for "attention" a function, for
"radix_cache" and "block_manager" a `(pool, max_requests) -> KVManager` (`GuardedRadixKV`,
`GuardedBlockKV`: chapter 6's cache modes over the part's guard), for "scheduler" the class itself:
a scheduler acts only through its KV manager, which checks every call and, after every step, slot
conservation and one row per running request.
"""

from __future__ import annotations

from functools import partial

from kvlearn.parts.conformance import SUITES, contract_members
from kvlearn.parts.guard import AllocatorGuard, guard_attention
from kvlearn.parts.guard_caches import BlockManagerGuard, RadixGuard
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import BlockKV, RadixKV
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.request import Request


class GuardedKV:
    """What the guarded modes share (first base of `GuardedRadixKV` and `GuardedBlockKV`): the
    cache is a learner's part behind `guard`. After a PartError the part is asked nothing more: a
    request that leaves gives back only what the guard's account says is its own (`drop_request`),
    and once no request holds KV the guard empties the part (`recover`)."""

    @property
    def cache(self):
        return self.guard.part

    def foreign_parts(self) -> list[tuple[str, object]]:
        return super().foreign_parts() + [(self.guard.name, self.guard.part)]

    def recover(self) -> None:
        """Mutation: a broken part, with no request holding KV, is emptied (`guard.drop_all`)."""
        if self.guard.broken and self.rows.num_free == len(self.rows.lengths):
            self.guard.drop_all()

    def admit(self, req: Request) -> int | None:
        self.recover()
        return super().admit(req)

    def release(self, req: Request) -> None:
        if not self.guard.broken:
            return super().release(req)
        self.drop_request(req)
        self._close_row(req)
        self.recover()

    def evict_all(self) -> int:
        self.recover()
        return super().evict_all()


class GuardedRadixKV(GuardedKV, RadixKV):
    """`RadixKV` over a learner's tree class `radix_cache`, behind a `RadixGuard` that checks each of its answers."""

    def __init__(self, radix_cache, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.tree = RadixGuard(radix_cache, pool)

    @property
    def guard(self) -> RadixGuard:
        return self.tree

    def drop_request(self, req: Request) -> None:
        """The slots of the request's row that the guard does not count as the tree's go back."""
        h = req.kv
        row = self.rows.req_to_token[h.row, :h.num_slots]
        self.pool.free(row[~self.tree.holds(row)])
        h.num_slots = h.prefix_len = 0


class GuardedBlockKV(GuardedKV, BlockKV):
    """`BlockKV` over a learner's block manager class, behind a `BlockManagerGuard`; after a PartError,
    once no table is live, every used page goes back and a fresh manager of the learner's class serves."""

    def __init__(self, block_manager, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS):
        super().__init__(pool, max_requests)
        self.manager = BlockManagerGuard(block_manager, pool)

    @property
    def guard(self) -> BlockManagerGuard:
        return self.manager

    def drop_request(self, req: Request) -> None:
        """Its table is forgotten: the pages go back when the manager is replaced."""
        req.block_table, req.num_cached_tokens = [], 0


def checked(name: str, part):
    """`part` when it has every method and property its contract lists (kvlearn.parts: each
    contract's own and those it extends), else TypeError naming what is missing; a function
    ("attention") is only called, so being callable (and no class) is its whole contract here."""
    if name == "attention" and isinstance(part, type):
        raise TypeError(f"parts['attention'] is a function like kvlearn.attention.paged_attention, got the class "
                        f"{part.__qualname__}.")
    contract = SUITES[name].contract
    missing = [m for m in contract_members(contract) if not hasattr(part, m)] if isinstance(part, type) else []
    if missing:
        raise TypeError(f"parts[{name!r}] ({part.__qualname__}) lacks {', '.join(missing)}: the {name} contract "
                        f"(kvlearn.parts.{contract.__name__}) lists them; write each one (help(kvlearn.parts."
                        f"{contract.__name__})), then check the part with kvlearn.parts.check({name!r}, "
                        f"{part.__qualname__}).")
    return part


GUARDS = {
    "allocator": lambda part: partial(AllocatorGuard, checked("allocator", part)),
    "attention": lambda part: guard_attention(checked("attention", part)),
    "radix_cache": lambda part: partial(GuardedRadixKV, checked("radix_cache", part)),
    "block_manager": lambda part: partial(GuardedBlockKV, checked("block_manager", part)),
    "scheduler": lambda part: checked("scheduler", part),
}
