"""The picture of what a decode kernel read (kvlearn.viz.kernel_reads), from real interpreted runs: the
worked kernel reads exactly each split's slots, and a kernel that reads past kv_len shows it."""

import pytest
import torch

import kvlearn.kernels
from tests.kernel_variants import kernel_copy

pytestmark = pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None or torch.cuda.is_available(),
                                reason="the interpreter's loads are recorded: Triton on a CPU only")


def step():
    """Two sequences sharing pages 7 and 2 of a pool of 8 pages of 16 slots, 3 KV heads, 2 splits."""
    torch.manual_seed(0)
    caches = torch.randn(8 * 16, 3, 64), torch.randn(8 * 16, 3, 64)
    return (torch.randn(2, 9, 64), *caches, torch.tensor([[7, 2, 5, 0], [7, 2, 3, 0]]), torch.tensor([50, 40]),
            64 ** -0.5, 16, 2)


def test_the_worked_kernel_reads_each_splits_slots_and_nothing_else():
    from kvlearn.viz.kernel_reads import draw_kernel_reads, kernel_reads

    reads = kernel_reads(None, *step())
    assert sorted(reads.slots) == [(b, g, s) for b in range(2) for g in range(3) for s in range(2)]
    for (b, g, s), slots in reads.slots.items():
        assert slots == sorted(reads.expected(b, s))
    assert reads.slots[(0, 0, 0)] == list(range(32, 41)) + list(range(112, 128))   # pages 7, then 2: positions 0-24
    assert reads.outside() == {}
    assert draw_kernel_reads(reads).axes


def test_a_kernel_that_reads_past_kv_len_shows_it(tmp_path):
    from kvlearn.viz.kernel_reads import kernel_reads

    past = kernel_copy(tmp_path, "ok = pos < end", "ok = pos <= end")
    outside = kernel_reads(past, *step()).outside()
    # Each program read one slot past its split: the next split's first, or the one after kv_len.
    assert sorted(outside) == [(b, g, s) for b in range(2) for g in range(3) for s in range(2)]
    assert all(len(slots) == 1 for slots in outside.values())
    assert outside[(1, 0, 1)] == [3 * 16 + 40 - 32]   # sequence 1's position 40, in its third page (3)
