"""The conformance suite of the `block_table` part (chapter 1): the `block_manager` suite with prefix
caching off (`suite_block_manager` with `caching=False`), and hints in chapter 1's words.

The part is built as `cls(num_blocks, block_size, enable_prefix_caching=False, allocator=allocator)`
and judged by `BlockReference(..., caching=False)`: programs of allocate, append (may_append, or a
preemption when there is no room), deallocate, misuse and `slot_mapping`, with every block's
ref_count, the free blocks (which, and in what order: a deallocate gives its blocks back in table
order) and the live tables compared after each call; a deallocated sequence has an empty table and
`num_cached_tokens` 0.
"""

from __future__ import annotations

import random

from kvlearn.parts import suite_block_manager
from kvlearn.parts.block_manager import BlockTablePart
from kvlearn.parts.judge import Trace

CONTRACT = BlockTablePart

# The block_manager suite's hints, less what chapter 1 never asks, with its own words where they differ.
HINTS = {key: hint for key, hint in suite_block_manager.HINTS.items()
         if key not in ("collision", "hit", "share", "walk", "duplicate", "publish", "count", "stats",
                        "evict_cached")}
HINTS |= {
    "table": "allocate gives the sequence one block per logical block (seq.num_blocks of them, the first "
             "logical block first); without prefix caching seq.num_cached_tokens stays 0 (chapter 1).",
    "take": "new blocks come from the allocator's free pages (self.allocator.alloc(n) hands out n of them), and "
            "a block belongs to one table at a time: never hand out a block that a live table holds.",
    "free": "deallocate gives every block of the table back to the allocator (self.allocator.free(ids), ids a "
            "1-D int64 tensor), so num_free_blocks and free_block_ids count them again.",
    "order": "deallocate gives the blocks nobody holds back to the free list in table order, in one "
             "self.allocator.free(ids) call: the table's first block is then handed out first (chapter 1: back "
             "to the free list, in table order; one free call per block would reverse them).",
    "misuse": "deallocate, may_append, can_append and slot_mapping raise ValueError for a sequence that is not "
              "allocated (never, or already deallocated), allocate for one that is, and they change nothing "
              "(BlockManagerBase.check_live, check_new); deallocate empties seq.block_table.",
    "reset": "deallocate sets seq.num_cached_tokens back to 0 and empties seq.block_table: a sequence without a "
             "table has no token in the cache (chapter 1).",
}


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    return suite_block_manager.generate(rng, caching=False)


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    suite_block_manager.run(impl, setup, ops, trace, caching=False, hints=HINTS)
