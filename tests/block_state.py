"""A comparable picture of everything a BlockManager (and the given sequences) holds.

Tests take one before a call that must fail and compare it after: a rejected call changes nothing.
"""


def snapshot(manager, seqs=()):
    return (
        [(b.block_id, b.ref_count, b.hash, tuple(b.token_ids)) for b in manager.blocks],
        manager.free_block_ids,
        sorted(manager.hash_to_block_id.items()),
        repr(manager.stats),
        [(s.seq_id, tuple(s.token_ids), tuple(s.block_table), s.num_cached_tokens) for s in seqs],
    )
