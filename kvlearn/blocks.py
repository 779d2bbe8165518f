"""Paged KV blocks with hash-based prefix reuse: the block manager of nano-vllm / vLLM v1.

The KV pool is cut into `num_blocks` blocks of `block_size` token slots: a block is a page of the
pool, and fresh blocks come from the pool's one allocator (`kvlearn.allocator.PageAllocator`; a
manager without a pool gets an allocator of its own). Token position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Prefix reuse: a full block whose KV has been computed is published under a chained hash
`h_i = hash_fn(h_{i-1}, tokens of block i)`, so (with a strong hash) equal hashes mean equal
prefixes, not just equal blocks. The collision guard checks what it can without rehashing: a hit
needs the stored tokens and the stored parent hash to be equal too.
A new sequence walks its full blocks and shares every published block it finds, up to the first
miss. A block whose last user leaves keeps its hash and tokens if it is the published copy: it
stays with the manager, still hittable, as the cache's evictable part. Every other block whose last
user leaves goes back to the allocator. A new block is a free page of the allocator when there is
one; only when there is none is a cached block evicted, least recently freed first.

How an engine drives it (every token's KV is written before `hash_blocks` sees it):

    if manager.can_allocate(seq): manager.allocate(seq)   # table covers the prompt
    forward(seq.token_ids[seq.num_cached_tokens:])        # writes KV at slot_mapping(...)
    manager.hash_blocks(seq)                              # publish the full, computed blocks
    loop:
        seq.append_token(sample())                        # this token has no KV yet
        if not manager.can_append(seq): preempt (deallocate) someone
        manager.may_append(seq)                           # a slot for the new token
        forward([last token]); manager.hash_blocks(seq)
    manager.deallocate(seq)

Invariants, kept by every public method:
- every block is exactly one of: free in the allocator (ref_count 0, no hash), cached (ref_count 0,
  its hash published, in the manager's LRU list) or in use (ref_count > 0); ref_count equals the
  number of live block tables holding the block;
- `hash_to_block_id` maps a hash only to a block that is full, computed, and still holds the tokens
  that hash was made from;
- a sequence never gets its last token from the cache (`num_cached_tokens < num_tokens`), so the
  model always has a position to take logits from and never writes into a shared block.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlearn.blocks_base import Block, BlockManagerBase, HashFn, PrefixCacheStats, hash_block_tokens, short_hash
from kvlearn.errors import KVCapacityError, check_int
from kvlearn.sequence import Sequence

__all__ = ["Block", "BlockManager", "BlockManagerBase", "HashFn", "PrefixCacheStats", "hash_block_tokens",
           "short_hash"]


class BlockManager(BlockManagerBase):
    """Allocates physical blocks to sequences and shares the blocks of common prefixes. From
    `BlockManagerBase` (kvlearn/blocks_base.py, the base a learner's block table and manager
    inherit too): the sizes and checks, `blocks`, the allocator, the cache's LRU list, the counters."""

    # --- prefix lookup ---------------------------------------------------------------------

    def _max_cached_blocks(self, num_tokens: int) -> int:
        # The full-hit rule: at least the last token is computed, so the model has logits to
        # sample from. Dropping the whole last block (not just one token) means the recomputed
        # KV goes into a private block, never into one that other sequences are reading.
        return (num_tokens - 1) // self.block_size

    def _match(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest published prefix of these tokens. Reads only; changes nothing."""
        if not self.enable_prefix_caching:
            return []
        hit, h, size = [], None, self.block_size
        for i in range(self._max_cached_blocks(len(token_ids))):
            tokens = token_ids[i * size:(i + 1) * size]
            parent, h = h, self.hash_fn(h, tokens)
            block_id = self.hash_to_block_id.get(h)
            # Equal hashes with unequal tokens or a different parent is a collision: treat it as a
            # miss. Stop at the first miss: every later block's KV was computed after this one's.
            if block_id is None or (self.blocks[block_id].token_ids, self.blocks[block_id].parent_hash) \
                    != (tokens, parent):
                break
            hit.append(block_id)
        return hit

    def num_cached_prefix(self, seq) -> int:
        """Tokens of `seq` (a Sequence, or a list of token ids) that `allocate` would take from the
        cache now; changes no state or stats."""
        if isinstance(seq, Sequence):
            self.check_seq(seq)
            seq = seq.token_ids
        return len(self._match(list(seq))) * self.block_size

    def _blocks_needed(self, seq: Sequence, hit: list[int]) -> int:
        # A hit on a free (cached) block still takes it off the free list; only hits on blocks
        # that are already in use come for free.
        return seq.num_blocks - sum(self.blocks[b].ref_count > 0 for b in hit)

    # --- allocation ------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would succeed now."""
        self.check_new(seq)
        return self._blocks_needed(seq, self._match(seq.token_ids)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table covering all its tokens, sharing its cached prefix.

        Sets `seq.block_table` and `seq.num_cached_tokens`; the caller computes the KV of
        `seq.token_ids[seq.num_cached_tokens:]`, then calls `hash_blocks(seq)`.
        Raises KVCapacityError (and changes nothing) when there are not enough free blocks.
        """
        self.check_new(seq)
        hit = self._match(seq.token_ids)
        needed = self._blocks_needed(seq, hit)
        if needed > self.num_free_blocks:
            hint = ("it can never fit: use more blocks or a shorter prompt" if seq.num_blocks > self.num_blocks
                    else "deallocate finished sequences first (check can_allocate)")
            raise KVCapacityError(f"Sequence {seq.seq_id} needs {needed} free blocks but only "
                                  f"{self.num_free_blocks} are free: {hint}.")
        fresh = self._fresh_pages(seq.num_blocks - len(hit))  # the one call that may fail: before any change
        for block_id in hit:  # before any miss evicts a cached block, so no hit is handed out
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_blocks[block_id]
            block.ref_count += 1
        seq.block_table[:] = hit + self._claim(fresh, seq.num_blocks - len(hit))
        seq.num_cached_tokens = len(hit) * self.block_size
        self.live_seqs.add(seq.seq_id)
        self.count_hits(seq)

    def _fresh_pages(self, n: int) -> list[int]:
        """Up to `n` free pages from the allocator: new blocks come from there first."""
        fresh = min(n, self.allocator.num_free)
        return self.allocator.alloc(fresh).tolist() if fresh else []

    def _claim(self, fresh: list[int], n: int) -> list[int]:
        """`n` blocks for new KV (the caller checked there are enough): the `fresh` pages, then
        cached blocks, least recently freed first, each forgetting what it cached."""
        taken = fresh + [self.evict_one() for _ in range(n - len(fresh))]
        for block_id in taken:
            self.blocks[block_id].ref_count = 1
        return taken

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> int:
        """Publish the full blocks of `seq` whose KV is computed; returns how many were newly hashed.

        num_computed_tokens: tokens of `seq` whose KV is written (default: all of them; pass less
        for a chunked prefill). Never call it between `append_token` and the forward pass that
        computes that token. Each full block without a hash gets its chained hash and tokens, and
        `hash_to_block_id` gets the hash unless it already points at another block: that first
        block stays the published copy, and this one is a copy (one is enough), unpublished for
        good but keeping its hash, so no later call hashes it again.
        """
        self.check_live(seq)
        covered = min(seq.num_tokens, len(seq.block_table) * self.block_size)
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_tokens
        check_int("num_computed_tokens", num_computed_tokens)
        if not 0 <= num_computed_tokens <= covered:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} is outside 0..{covered}, the tokens of "
                             f"sequence {seq.seq_id} that have slots: call may_append after append_token.")
        if not self.enable_prefix_caching:
            return 0
        num_full = num_computed_tokens // self.block_size
        # Hashed blocks form a prefix of the table (hits, then earlier calls): find its end.
        start = num_full
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash is None:
            start -= 1
        h = self.blocks[seq.block_table[start - 1]].hash if start else None
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            tokens = seq.block(i)
            parent, h = h, self.hash_fn(h, tokens)
            block.hash, block.token_ids, block.parent_hash = h, tokens, parent
            self.hash_to_block_id.setdefault(h, block.block_id)
        return num_full - start

    def can_append(self, seq: Sequence) -> bool:
        """Whether `may_append(seq)` would succeed now (it needs a free block at a block boundary)."""
        self.check_live(seq)
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """After `seq.append_token(t)`: grow the block table so every token has a slot."""
        self.check_live(seq)
        needed = seq.num_blocks - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise KVCapacityError(f"Sequence {seq.seq_id} needs {needed} new block(s) but only "
                                  f"{self.num_free_blocks} are free: "
                                  "preempt (deallocate) a sequence first (check can_append).")
        seq.block_table.extend(self._claim(self._fresh_pages(needed), needed))

    def deallocate(self, seq: Sequence) -> None:
        """Release the blocks of `seq`. A block nobody holds any more stays cached (at the back of
        the LRU list) if it is the published copy of its prefix, and goes back to the allocator
        otherwise. The table is walked in reverse, so a prefix's tail is evicted before its head.
        `seq` is left with an empty table and `num_cached_tokens` 0."""
        self.check_live(seq)
        last_user = [b for b in reversed(seq.block_table) if self.blocks[b].ref_count == 1]
        released = [b for b in last_user if self.hash_to_block_id.get(self.blocks[b].hash) != b]
        # The one call that may fail, before any change; table order, so the head is reused first.
        self.allocator.free(torch.tensor(released[::-1], dtype=torch.int64))
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count -= 1
        for block_id in last_user:
            if block_id in released:
                self.forget(self.blocks[block_id])
            else:
                self.cached_blocks[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        self.live_seqs.discard(seq.seq_id)

    # --- what the paged-attention runner consumes -------------------------------------------

    def slot_mapping(self, seq: Sequence, start: int, end: int, device=None) -> torch.Tensor:
        """KV slots of token positions [start, end) of `seq`: a 1-D int64 tensor."""
        self.check_live(seq)
        check_int("start", start, what=" (a token position)")
        check_int("end", end, what=" (a token position)")
        covered = min(seq.num_tokens, len(seq.block_table) * self.block_size)
        if not 0 <= start <= end <= covered:
            raise ValueError(f"Need 0 <= start <= end <= {covered} (tokens of sequence {seq.seq_id} with slots), "
                             f"got start={start}, end={end}: call may_append after append_token.")
        positions = torch.arange(start, end, device=device)
        table = torch.tensor(seq.block_table, dtype=torch.int64, device=device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def block_tables(self, seqs: list[Sequence], device=None) -> torch.Tensor:
        """Block tables of a batch as one [len(seqs), longest table] int64 tensor, padded with -1."""
        for seq in seqs:
            self.check_live(seq)
        width = max((len(s.block_table) for s in seqs), default=0)
        rows = np.full((len(seqs), width), -1, dtype=np.int64)  # numpy fills rows from lists ~3x faster
        for i, seq in enumerate(seqs):
            rows[i, :len(seq.block_table)] = seq.block_table
        return torch.as_tensor(rows, device=device)
