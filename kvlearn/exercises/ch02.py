"""Chapter 2's small exercise (the build exercise, `MyBlockManager`, is checked by
`kvlearn.parts.check("block_manager", ...)`): a prompt that leaves a cached path inside a block."""

from kvlearn.blocks import BlockManager
from kvlearn.exercises import report
from kvlearn.sequence import Sequence


def _run(manager, token_ids, finish=True):
    """Allocate one request, compute (publish) its blocks and, if finish, deallocate it."""
    seq = Sequence(token_ids, block_size=manager.block_size)
    manager.allocate(seq)
    manager.hash_blocks(seq)
    if finish:
        manager.deallocate(seq)
    return seq


DIVERGE_A, DIVERGE_B = list(range(10)), [0, 1, 2, 3, 4, 5, 99, 100, 101, 102, 103]


def check_divergence(num_cached_tokens, block_table) -> bool:
    """Exercise 1: BlockManager(3, block_size=4). A = DIVERGE_A (tokens 0..9) runs and finishes.
    B = DIVERGE_B agrees with A on its first 6 tokens, so it leaves A's path inside block 1. How many
    tokens does B take from the cache, and which blocks does it get, in table order?"""
    manager = BlockManager(3, 4)
    _run(manager, DIVERGE_A)
    b = _run(manager, DIVERGE_B, finish=False)
    if num_cached_tokens != b.num_cached_tokens:
        return report(False, "a block is found by the hash of its whole prefix: B matches A's first block, "
                             "but does B's second block hash like A's if only half of it agrees?")
    ok = isinstance(block_table, (list, tuple)) and list(block_table) == b.block_table
    return report(ok, "after A finishes, which of its blocks are cached and which are free pages? B takes its "
                      "hit, then free pages, then evicts the least recently freed cached block.")
