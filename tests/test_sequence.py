"""Sequence: logical blocks by hand, and bad input rejected before anything is built."""

import numpy as np
import pytest
import torch

from kvlearn import Sequence


def test_blocks_by_hand():
    seq = Sequence(list(range(10, 20)), block_size=4)
    assert (seq.num_tokens, len(seq), seq.num_blocks, seq.num_prompt_tokens) == (10, 10, 3, 10)
    assert seq.block(0) == [10, 11, 12, 13]
    assert seq.block(2) == [18, 19]  # the last block is partly filled
    assert (seq.block_table, seq.num_cached_tokens) == ([], 0)


@pytest.mark.parametrize("n, block_size, blocks", [(1, 1, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2)])
def test_num_blocks_is_ceiling(n, block_size, blocks):
    assert Sequence([1] * n, block_size=block_size).num_blocks == blocks


def test_append_token_crosses_a_block_boundary():
    seq = Sequence([1, 2, 3, 4], block_size=4)
    seq.append_token(5)
    assert (seq.num_tokens, seq.num_blocks, seq.block(1), seq.num_prompt_tokens) == (5, 2, [5], 4)


def test_block_returns_a_copy():
    seq = Sequence([1, 2, 3], block_size=2)
    seq.block(0).append(99)
    assert seq.token_ids == [1, 2, 3]


def test_array_inputs_become_python_ints():
    for ids in (np.array([3, 4, 5]), torch.tensor([3, 4, 5]), (3, 4, 5), range(3, 6), [np.int64(3), 4, np.int32(5)]):
        seq = Sequence(ids, block_size=2)
        assert seq.token_ids == [3, 4, 5] and all(type(t) is int for t in seq.token_ids)


def test_ids_are_unique_and_repr_is_readable():
    a, b = Sequence([1, 2, 3], block_size=2), Sequence([1, 2, 3], block_size=2)
    assert a.seq_id != b.seq_id
    assert repr(a) == f"Sequence(seq_id={a.seq_id}, num_tokens=3, tokens=[1 2 3], block_table=[], num_cached_tokens=0)"
    assert "..." in repr(Sequence(list(range(9)), block_size=2))


@pytest.mark.parametrize("ids, error, words", [
    ([], ValueError, "at least one token"),
    ([1, -2], ValueError, ">= 0"),
    ([1, 2.0], TypeError, "position 1"),
    ([True], TypeError, "must be ints"),
    ("hello", TypeError, "tokenize"),
    (7, TypeError, "list of ints"),
])
def test_bad_token_ids(ids, error, words):
    with pytest.raises(error, match=words):
        Sequence(ids)


@pytest.mark.parametrize("block_size, error", [(0, ValueError), (-4, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_block_size(block_size, error):
    with pytest.raises(error, match="block_size"):
        Sequence([1, 2], block_size=block_size)


@pytest.mark.parametrize("token, error", [(-1, ValueError), ("7", TypeError), (1.0, TypeError)])
def test_bad_append_leaves_the_sequence_unchanged(token, error):
    seq = Sequence([1, 2], block_size=2)
    with pytest.raises(error):
        seq.append_token(token)
    assert seq.token_ids == [1, 2]


def test_block_index_out_of_range():
    with pytest.raises(IndexError, match="blocks 0..1"):
        Sequence([1, 2, 3], block_size=2).block(2)
