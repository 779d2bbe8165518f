"""Chapter 2's small exercise (the build exercise, `MyBlockManager`, is checked by
`kvlearn.parts.check("block_manager", ...)`): a prompt that leaves a cached path inside a block."""

from kvlearn.blocks import BlockManager
from kvlearn.exercises import likely_mistake, report
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
        return report(False, likely_mistake(num_cached_tokens, [
            (6, "a block is found by the hash of its whole prefix: B matches A's first block, but does B's second "
                "block hash like A's if only half of it agrees?"),
            (8, "B's second block differs from A's in its last two tokens, so its hash differs: B cannot take it."),
            (0, "B's first block holds the same 4 tokens as A's first block, with the same (empty) prefix before "
                "them: the same hash, so B finds it.")]) or
            "count the tokens of the blocks B finds by hash: whole blocks only, from the start.")
    table = list(block_table) if isinstance(block_table, (list, tuple)) else block_table
    ok = table == b.block_table
    return report(ok, likely_mistake(table, [
        ([0, 1, 2], "B's second block is not a hit (its hash differs), so block 1 is still A's cached block; B takes "
                    "the free page first, and only then evicts a cached block."),
        ([0, 2], "B holds 11 tokens: three blocks of 4.")]) or
        "after A finishes, which of its blocks are cached and which are free pages? B takes its "
        "hit, then free pages, then evicts the least recently freed cached block.")
