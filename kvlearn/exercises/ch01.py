"""Chapter 1's small exercises (the build exercise, `MyBlockTable`, is checked by
`kvlearn.parts.check("block_table", ...)`): positions from slots, waste under paging."""

from kvlearn.blocks import BlockManager
from kvlearn.exercises import attempt, report
from kvlearn.sequence import Sequence


def check_position(position_of) -> bool:
    """Exercise 1: `position_of(block_table, block_size, slot)` is the inverse of the slot formula: the
    token position of the request whose KV lives in `slot`, or None if the slot's block is not in
    the table."""
    manager = BlockManager(8, 4, enable_prefix_caching=False)
    seqs = [Sequence([1] * n, block_size=4) for n in (8, 12, 4)]
    for s in seqs:
        manager.allocate(s)
    manager.deallocate(seqs[0])  # so the last table is not in order 0, 1, 2, ...
    late = Sequence([1] * 16, block_size=4)
    manager.allocate(late)
    for s in seqs[1:] + [late]:
        expected = {slot: p for p, slot in enumerate(manager.slot_mapping(s, 0, s.num_tokens).tolist())}
        for slot in range(manager.num_blocks * 4):
            got, error = attempt(position_of, list(s.block_table), 4, slot)
            if error or got != expected.get(slot):
                return report(False, error or f"block_table={s.block_table}, block_size=4, slot={slot}: expected "
                              f"{expected.get(slot)}, got {got}. Which physical block holds the slot, and "
                              "where is that block in the table?")
    return report(True, "")


def check_waste(paged_waste) -> bool:
    """Exercise 2: `paged_waste(lengths, block_size)` returns the slots allocated but unused when
    sequences of these lengths are stored in blocks of `block_size`."""
    cases = [([1], 16), ([16], 16), ([17, 3], 16), ([100, 250, 7], 32), ([5, 5, 5], 1)]
    for lengths, block_size in cases:
        expected = sum(Sequence([0] * n, block_size=block_size).num_blocks * block_size - n for n in lengths)
        got, error = attempt(paged_waste, list(lengths), block_size)
        if error or got != expected:
            return report(False, error or f"lengths={lengths}, block_size={block_size}: expected {expected}, "
                          f"got {got}. Only the last block of each sequence can be partly empty.")
    return report(True, "")
