"""Chapter 2 exercises: how much of a prompt is cached, a prompt that leaves a cached path inside a block,
which blocks a new request gets."""

from kvlearn.blocks import BlockManager
from kvlearn.exercises import attempt, report
from kvlearn.sequence import Sequence


def _run(manager, token_ids, finish=True):
    """Allocate one request, compute (publish) its blocks and, if finish, deallocate it."""
    seq = Sequence(token_ids, block_size=manager.block_size)
    manager.allocate(seq)
    manager.hash_blocks(seq)
    if finish:
        manager.deallocate(seq)
    return seq


CACHED_CASES = [
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8, 9], 4),      # two full blocks shared
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8], 4),         # all cached: last block recomputed
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 0, 0, 0], 4),      # second block differs
    ([[9, 9, 9, 9, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8, 0], 4),      # same block 1, other prefix
    ([[1, 2, 3], [1, 2, 5, 6, 7]], [1, 2, 5, 6, 7, 8, 9], 2),          # the best of two cached prompts
    ([[1, 2, 3, 4, 5]], [1, 2, 3], 4),                                 # shorter than a block
]


def check_cached_tokens(cached_tokens) -> bool:
    """Exercise 1: `cached_tokens(cached_prompts, new_prompt, block_size)` returns how many tokens of
    `new_prompt` a BlockManager takes from the cache, when every prompt in `cached_prompts` ran to
    completion before (and nothing was evicted). Work it out from the tokens, without hashes."""
    for cached_prompts, new_prompt, block_size in CACHED_CASES:
        manager = BlockManager(64, block_size)
        for prompt in cached_prompts:
            _run(manager, prompt)
        expected = manager.num_cached_prefix(Sequence(new_prompt, block_size=block_size))
        got, error = attempt(cached_tokens, [list(p) for p in cached_prompts], list(new_prompt), block_size)
        if error or got != expected:
            return report(False, error or f"cached={cached_prompts}, new={new_prompt}, block_size={block_size}: "
                          f"expected {expected}, got {got}. Whole blocks only, counted from the start, and the "
                          "last token is never taken from the cache.")
    return report(True, "")


DIVERGE_A, DIVERGE_B = list(range(10)), [0, 1, 2, 3, 4, 5, 99, 100, 101, 102, 103]


def check_divergence(num_cached_tokens, block_table) -> bool:
    """Exercise 2: BlockManager(3, block_size=4). A = DIVERGE_A (tokens 0..9) runs and finishes.
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


def check_reused_block(answer) -> bool:
    """Exercise 3: BlockManager(4, block_size=2). Request X = [1, 2, 3, 4] runs and finishes, then
    Y = [5, 6, 7] runs and finishes. Z = [9, 10, 11, 12, 13] arrives. Which blocks does Z get, in
    table order?"""
    manager = BlockManager(4, 2)
    _run(manager, [1, 2, 3, 4])
    _run(manager, [5, 6, 7])
    expected = _run(manager, [9, 10, 11, 12, 13], finish=False).block_table
    ok = isinstance(answer, (list, tuple)) and list(answer) == expected
    return report(ok, "write down after each step which blocks are free pages and which are cached: a new "
                      "block is a free page if there is one; only then is a cached block evicted, the least "
                      "recently freed first (a table is freed from its last block to its first).")
