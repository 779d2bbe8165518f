"""Blocks (`Block`, the chained hash `hash_block_tokens`) and `BlockManagerBase`: the bookkeeping of
a block manager that chapters 1-2 do not teach, inherited by the package's `kvlearn.BlockManager`
(kvlearn/blocks.py, the chapters' answer) and by a learner's block table and manager alike
(`kvlearn.parts.BlockManagerBase` is this class)."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from kvlearn.allocator import PageAllocator
from kvlearn.errors import check_positive_int
from kvlearn.sequence import Sequence, shorten

HashFn = Callable[["int | None", "list[int]"], int]


def hash_block_tokens(parent_hash: int | None, token_ids: list[int]) -> int:
    """Stable 64-bit chained hash of one block: xxh64(parent hash bytes + token ids as int64).

    Stable across processes and machines, unlike Python's salted `hash()`.
    """
    data = array("q", token_ids).tobytes()
    if parent_hash is not None:
        data = parent_hash.to_bytes(8, "little") + data
    return xxhash.xxh64_intdigest(data)


def short_hash(h: int | None) -> str:
    """The first 6 hex digits of a hash, or '-' for none: enough to tell blocks apart by eye."""
    return "-" if h is None else f"{h:x}"[:6]


@dataclass
class Block:
    """One physical block. `hash` and `token_ids` are set once it is full and computed."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    parent_hash: int | None = None  # hash of the block before it when its KV was computed

    def __repr__(self) -> str:
        return (f"Block(block_id={self.block_id}, ref_count={self.ref_count}, hash={short_hash(self.hash)}, "
                f"tokens=[{shorten(self.token_ids)}])")


@dataclass
class PrefixCacheStats:
    """Counted by `allocate` only (queries such as `num_cached_prefix` are free)."""

    queries: int = 0        # sequences looked up in the cache
    evicted_blocks: int = 0  # cached blocks whose hash was dropped to reuse them (evict_cached too)
    query_tokens: int = 0   # their tokens
    hit_blocks: int = 0     # blocks shared instead of computed
    hit_tokens: int = 0     # tokens whose KV came from the cache (hit_blocks * block_size)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockManagerBase:
    """The bookkeeping around a block manager that chapters 1-2 do not teach: sizes and checks of
    the constructor's arguments, the `blocks` list, the pool's allocator, the counters, the
    questions pictures ask (free, cached), and the bad-input checks every method starts with.

    A learner's block table (chapter 1, `kvlearn.parts.BlockTablePart`: allocate / may_append /
    deallocate and slot_mapping) and block manager (chapter 2, `kvlearn.parts.BlockManagerPart`: the
    hash-chain lookup, hash_blocks, least-recently-freed reuse) may inherit from it and write just
    the chapters' part. It keeps two structures for them to fill:
    - `cached_blocks`: an OrderedDict of the block ids nobody uses whose prefix can still be hit,
      least recently freed first (put a block at the end when its last user leaves; take the first
      to reuse one, through `evict_one`);
    - `live_seqs`: the seq_ids that hold a block table from this manager (add in `allocate`,
      discard in `deallocate`); `check_new` and `check_live` read it.
    `allocate` counts each sequence in `stats` with `count_hits(seq)`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn | None = None, allocator: PageAllocator | None = None):
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size, " (tokens per block)")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable as hash_fn(parent_hash, token_ids), got {hash_fn!r}.")
        if allocator is not None and (getattr(allocator, "num_pages", None) != num_blocks
                                      or getattr(allocator, "num_free", None) != num_blocks):
            raise ValueError(f"allocator must be an untouched page allocator of {num_blocks} pages (a pool's "
                             f"`allocator`, with pages of block_size slots), got {allocator!r}.")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn: HashFn = hash_fn or hash_block_tokens
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.allocator = allocator or PageAllocator(num_blocks, device="cpu")
        # Cached blocks nobody uses, least recently freed first: prefixes freed last survive longest.
        self.cached_blocks: OrderedDict[int, None] = OrderedDict()
        self.live_seqs: set[int] = set()  # seq_ids whose block table came from this manager
        self.stats = PrefixCacheStats()

    # --- state ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: free in the allocator, or cached and nobody's."""
        return self.allocator.num_free + len(self.cached_blocks)

    @property
    def free_block_ids(self) -> list[int]:
        """Blocks in the order they will be handed out: the allocator's free pages, then cached
        blocks, least recently freed first."""
        return self.allocator.free_pages + list(self.cached_blocks)

    def is_cached(self, block_id: int) -> bool:
        """Whether a block nobody uses can still be hit (its hash is the published one)."""
        return block_id in self.cached_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Blocks nobody uses whose published prefix can still be hit: the cache's evictable part."""
        return len(self.cached_blocks)

    def evict_cached(self) -> int:
        """Forget every published prefix held only by the cache and give those blocks back to the
        allocator; returns the tokens forgotten. Blocks in use keep their hashes."""
        evicted = list(self.cached_blocks)
        self.allocator.free(torch.tensor(evicted, dtype=torch.int64))  # may fail: before any change
        for b in evicted:
            self.forget(self.blocks[b])
        self.cached_blocks.clear()
        self.stats.evicted_blocks += len(evicted)
        return len(evicted) * self.block_size

    def count_hits(self, seq: Sequence) -> None:
        """Count an allocation in `stats`, once `seq.num_cached_tokens` is set (with prefix caching
        only): `allocate` calls it for each sequence it gives a table; queries never do."""
        if self.enable_prefix_caching:
            self.stats.queries += 1
            self.stats.query_tokens += seq.num_tokens
            self.stats.hit_blocks += seq.num_cached_tokens // self.block_size
            self.stats.hit_tokens += seq.num_cached_tokens

    def evict_one(self) -> int:
        """Take the least recently freed cached block for new KV: its hash must stop pointing here."""
        block_id, _ = self.cached_blocks.popitem(last=False)
        self.forget(self.blocks[block_id])
        self.stats.evicted_blocks += 1
        return block_id

    def forget(self, block: Block) -> None:
        """Drop what the block caches: its KV is about to be overwritten or is garbage."""
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.parent_hash = None, [], None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks} ({self.num_cached_free_blocks} still cached), "
                f"hashed={len(self.hash_to_block_id)}, live_seqs={len(self.live_seqs)})")

    # --- checks: every public method validates before it changes anything -----------------

    def check_seq(self, seq) -> None:
        """TypeError unless `seq` is a Sequence; ValueError unless it has this manager's block_size."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"Expected a kvlearn.Sequence, got {type(seq).__name__}.")
        if seq.block_size != self.block_size:
            raise ValueError(f"Sequence {seq.seq_id} has block_size {seq.block_size} but this manager uses "
                             f"{self.block_size}: build the Sequence with block_size={self.block_size}.")

    def check_new(self, seq) -> None:
        """`check_seq`, and ValueError if `seq` already holds a block table (allocate's check)."""
        self.check_seq(seq)
        if seq.seq_id in self.live_seqs or seq.block_table:
            raise ValueError(f"Sequence {seq.seq_id} already has a block table {seq.block_table}: "
                             "deallocate it before allocating it again.")

    def check_live(self, seq) -> None:
        """`check_seq`, and ValueError unless `seq` holds a block table from this manager."""
        self.check_seq(seq)
        if seq.seq_id not in self.live_seqs:
            raise ValueError(f"Sequence {seq.seq_id} is not allocated by this manager (never allocated, or "
                             "already deallocated): call allocate(seq) first.")
