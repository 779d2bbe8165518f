"""The `block_table` part (chapter 1) and the `block_manager` part (chapters 1-2), both built like
`kvlearn.BlockManager`: `cls(num_blocks, block_size, enable_prefix_caching=..., allocator=...)`.

`block_table` (prefix caching off) is checked and drawn in chapter 1 and serves no engine;
`block_manager` serves the engine's blocks mode, which calls only the members of `BlockManagerPart`
(pictures also read `blocks`, `is_cached` and `free_block_ids`). The checker also builds it with
`hash_fn=`, a chained hash that collides on purpose. `BlockManagerBase` (kvlearn/blocks_base.py,
re-exported here; `kvlearn.BlockManager` inherits it too) holds what the chapters do not teach.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvlearn.blocks_base import Block, BlockManagerBase, PrefixCacheStats
from kvlearn.sequence import Sequence

__all__ = ["BlockTablePart", "BlockManagerPart", "BlockManagerBase"]


class BlockTablePart(Protocol):
    """What chapter 1 asks of block tables (no prefix caching), and what pictures of them read.

    Rules (the chapter's): a sequence's table holds one block per logical block, new blocks are the
    allocator's free pages (`allocator.alloc`), and every block of a deallocated sequence goes back
    to the allocator in table order, in one `allocator.free` call (so the table's first block is
    handed out first next time); a block's `ref_count` is the number of live block tables that
    hold it. Token position p lives in slot `block_table[p // block_size] * block_size +
    p % block_size`. A call that cannot be served raises `kvlearn.KVCapacityError` (no room) or
    ValueError (a sequence allocated twice, or any other call on one deallocated or never
    allocated) and changes nothing.
    """

    block_size: int
    blocks: list[Block]        # blocks[i].block_id == i; ref_count (pictures)

    @property
    def num_blocks(self) -> int:
        """Query: blocks in the pool."""

    @property
    def num_free_blocks(self) -> int:
        """Query: blocks a sequence could get now."""

    @property
    def free_block_ids(self) -> list[int]:
        """Query: the blocks a sequence could get, in the order they are handed out."""

    def is_cached(self, block_id: int) -> bool:
        """Query: whether a block nobody uses can still be hit (never, without prefix caching)."""

    def can_allocate(self, seq: Sequence) -> bool:
        """Query: whether `allocate(seq)` would succeed now."""

    def allocate(self, seq: Sequence) -> None:
        """Mutation: fill `seq.block_table` (every token) and `seq.num_cached_tokens`."""

    def can_append(self, seq: Sequence) -> bool:
        """Query: whether `may_append(seq)` would succeed now."""

    def may_append(self, seq: Sequence) -> None:
        """Mutation: after `seq.append_token`, make sure every token has a block."""

    def deallocate(self, seq: Sequence) -> None:
        """Mutation: release the sequence's blocks, empty its table and set its
        `num_cached_tokens` to 0."""

    def slot_mapping(self, seq: Sequence, start: int, end: int, device=None) -> torch.Tensor:
        """Query: the KV slots of token positions [start, end), a 1-D int64 tensor."""


class BlockManagerPart(BlockTablePart, Protocol):
    """What the engine's blocks mode asks of a block manager (`kvlearn.serving.cache_modes.BlockKV`):
    `BlockTablePart`'s members, with prefix caching, and the members below.

    Rules (the chapters'): new blocks are the allocator's free pages first, then cached blocks
    nobody uses, least recently freed first (whatever such a block cached is forgotten); a full
    block is published (findable by its chained hash, `self.hash_fn(parent_hash, token_ids)`, the
    constructor's `hash_fn`) only by `hash_blocks`, once its KV is computed, and one copy per hash;
    a new sequence shares its longest published prefix, never its last token, and a block whose
    hash matches but whose tokens differ is a collision, a miss (the collision guard); a block's
    `ref_count` is the number of live block tables that hold it. A deallocated block nobody holds
    stays cached if it is the published copy of its prefix (`deallocate` walks the table from its
    last block, so the head of a prefix is evicted last); the others go back to the allocator in
    table order. `allocate` counts each sequence in `stats` (queries, query_tokens, hit_blocks,
    hit_tokens); queries count nothing. A call that cannot be served raises
    `kvlearn.KVCapacityError` (no room) or ValueError (a sequence deallocated twice or never
    allocated) and changes nothing.
    """

    stats: PrefixCacheStats    # allocate counts in it; the engine reads stats.evicted_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Query: blocks nobody uses whose prefix can still be hit (evictable)."""

    def num_cached_prefix(self, seq: Sequence | list[int]) -> int:
        """Query: tokens `allocate` would take from the cache now; changes nothing."""

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> int:
        """Mutation: hash the full blocks whose KV is computed and that have no hash yet; each is
        published unless another block already publishes its prefix (then it is a copy, never
        published, and keeps its hash so it is never hashed again). Returns how many got a hash."""

    def evict_cached(self) -> int:
        """Mutation: forget every cached block nobody uses; returns the tokens forgotten."""
