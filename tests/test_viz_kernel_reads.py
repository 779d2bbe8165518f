"""The picture of what a decode kernel read (kvlearn.viz.kernel_reads), from real interpreted runs: the
worked kernel reads exactly each split's slots, and a kernel that reads past kv_len shows it."""

from pathlib import Path

import pytest
import torch

import kvlearn.kernels
from tests.kernel_variants import kernel_copy

ROOT = Path(__file__).resolve().parents[1]

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
    for (b, _, s), slots in reads.slots.items():
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


def test_the_picture_says_whose_kernel_it_drew_and_where_one_was_stopped(tmp_path):
    from kvlearn.viz.kernel_reads import draw_kernel_reads, kernel_reads

    assert "the package's decode_kernel" in draw_kernel_reads(kernel_reads(None, *step())).axes[0].get_title()
    row_left_out = kernel_copy(tmp_path, "table + b * stride_tb + pos", "table + pos")
    reads = kernel_reads(row_left_out, *step())
    title = draw_kernel_reads(reads).axes[0].get_title()
    assert reads.kernel == "decode_kernel" and title.startswith("what each program of decode_kernel read")
    assert reads.stopped.startswith("program (b=1, kv_head=0, split=0) read table entry -4") and reads.stopped in title
    assert reads.slots[(0, 0, 0)] == sorted(reads.expected(0, 0))   # sequence 0's programs ran before the stop


def test_chapter_5_draws_the_learners_kernel_not_the_stand_in():
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "05_paged_attention.ipynb", as_version=4)
    drawn = [c.source for c in nb.cells if "kernel_reads(" in c.source and c.cell_type == "code"]
    assert len(drawn) == 1 and "kernel_reads(my_decode_kernel," in drawn[0]
