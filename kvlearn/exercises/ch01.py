"""Chapter 1's small exercises (the build exercise, `MyBlockTable`, is checked by
`kvlearn.parts.check("block_table", ...)`): positions from slots, waste under paging."""

from kvlearn.blocks import BlockManager
from kvlearn.exercises import attempt, given, likely_mistake, report
from kvlearn.sequence import Sequence


def _position_mistakes(table, bs, slot):
    """(answer, hint) of the likely mistakes of exercise 1 on these inputs."""
    block, offset = divmod(slot, bs)
    mistakes = [(slot, "A slot is not a position: find the table entry that holds the slot's block, then "
                       "count block_size positions per entry before it.")]
    if block < len(table):
        mistakes.append((table[block] * bs + offset, "That is the slot formula run forward (position -> slot): "
                                                     "invert it: from the slot's block to the table entry that "
                                                     "holds it."))
    if block in table:
        i = table.index(block)
        mistakes += [(i + offset, "Each table entry covers block_size positions: the entry's first position "
                                  "is its index times block_size."),   # before the next: equal at offset 0
                     (i, "That is the block's place in the table: add the slot's offset inside its block, "
                         "after block_size positions per entry before it.")]
    return mistakes


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
            shown = given(block_table=s.block_table, block_size=4, slot=slot)
            got, error = attempt(position_of, list(s.block_table), 4, slot, shown=shown)
            want = expected.get(slot)
            if error and want is None:
                return report(False, f"{error}. The slot's block {slot // 4} is not in the table: return None.")
            if error or got != want:
                return report(False, error or f"{shown}: expected {want}, got {got}. " + (
                    likely_mistake(got, _position_mistakes(s.block_table, 4, slot)) or
                    "Which physical block holds the slot, and where is that block in the table?"))
    return report(True, "")


def check_waste(paged_waste) -> bool:
    """Exercise 2: `paged_waste(lengths, block_size)` returns the slots allocated but unused when
    sequences of these lengths are stored in blocks of `block_size`."""
    cases = [([1], 16), ([16], 16), ([17, 3], 16), ([100, 250, 7], 32), ([5, 5, 5], 1)]
    for lengths, block_size in cases:
        blocks = [-(-n // block_size) for n in lengths]
        expected = sum(b * block_size - n for b, n in zip(blocks, lengths, strict=True))
        shown = given(lengths=lengths, block_size=block_size)
        got, error = attempt(paged_waste, list(lengths), block_size, shown=shown)
        if error or got != expected:
            mistakes = [(sum(block_size - n % block_size for n in lengths),
                         "A sequence that fills its last block wastes nothing: "
                         "only a partly filled last block wastes."),
                        (sum(blocks) * block_size, "That is every slot allocated: subtract the slots the tokens use."),
                        (sum(blocks), "That counts blocks: the waste is in slots, block_size per block.")]
            return report(False, error or f"{shown}: expected {expected}, got {got}. " + (
                likely_mistake(got, mistakes) or "Only the last block of each sequence can be partly empty."))
    return report(True, "")
