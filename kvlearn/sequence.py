"""A request's token ids and its block table: the logical view of its KV cache.

Logical block i of a sequence holds token positions [i * block_size, (i + 1) * block_size); only
the last one may be partly filled. The sequence owns no memory: a `BlockManager` fills
`block_table` (one physical block id per logical block) and `num_cached_tokens` (how many leading
tokens already had their KV in the cache when the sequence was allocated).
"""

from __future__ import annotations

import itertools

import numpy as np

from kvlearn.errors import check_positive_int

_seq_ids = itertools.count()
MAX_TOKEN_ID = 2**63 - 1  # ids are stored and hashed as int64


def _check_token_id(t, where: str) -> int:
    # bool is an int subclass, but True as a token id is always a mistake.
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise TypeError(f"Token ids must be ints; {where} holds {type(t).__name__} {t!r}.")
    if not 0 <= t <= MAX_TOKEN_ID:
        raise ValueError(f"Token ids must be >= 0 and < 2**63; {where} holds {t}.")
    return int(t)


def shorten(ids, limit: int = 8, more: str = " ...") -> str:
    """The first `limit` token ids as text, and `more` when there are others: for reprs and pictures."""
    return " ".join(map(str, ids[:limit])) + (more if len(ids) > limit else "")


class Sequence:
    """Token ids of one request plus where their KV lives.

    Invariants (kept by the BlockManager): `block_table` is empty while the sequence is not
    allocated; once allocated it has one entry per logical block (between `append_token` and the
    manager's `may_append`, the newest token may still lack one), and `num_cached_tokens` is a
    multiple of `block_size` smaller than `num_tokens`.
    """

    def __init__(self, token_ids, block_size: int = 16):
        check_positive_int("block_size", block_size, " (tokens per block)")
        if hasattr(token_ids, "tolist"):  # a numpy array or a torch tensor of ids
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise TypeError(f"token_ids must be a list of ints (tokenize text first), got {type(token_ids).__name__}.")
        token_ids = list(token_ids)
        # Fast path for the usual list of non-negative Python ints; the slow path says which id is bad.
        if set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID:
            token_ids = [_check_token_id(t, f"position {i}") for i, t in enumerate(token_ids)]
        if not token_ids:
            raise ValueError("A sequence needs at least one token id; got an empty list.")
        self.seq_id = next(_seq_ids)
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_cached_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold every token (the last one may be partly filled)."""
        return -(-self.num_tokens // self.block_size)

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i (a copy)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"Logical block {i} does not exist: this sequence has blocks 0..{self.num_blocks - 1}.")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        """Add a generated token. Its KV does not exist yet: the manager's `may_append` gives it a slot."""
        self.token_ids.append(_check_token_id(token_id, "append_token's argument"))

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, num_tokens={self.num_tokens}, tokens=[{shorten(self.token_ids)}], "
                f"block_table={self.block_table}, num_cached_tokens={self.num_cached_tokens})")
