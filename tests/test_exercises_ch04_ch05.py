"""The chapter 4 and 5 checkers accept a right answer and refuse wrong ones."""

import torch

from kvlearn.exercises import ch04, ch05


def paged_row(a_row, shared, b_len, new_pages, page_size):
    reused = shared // page_size * page_size
    fresh = [p * page_size + i for p in new_pages for i in range(page_size)]
    return a_row[:reused] + fresh[:b_len - reused]


def test_ch04_paged_row():
    assert ch04.check_paged_row(paged_row)
    assert ch04.check_paged_row(lambda *args: torch.tensor(paged_row(*args)))  # a tensor row is fine
    assert not ch04.check_paged_row(lambda a, s, n, p, ps: a[:s] + [q * ps + i for q in p for i in range(ps)][:n - s])
    assert not ch04.check_paged_row(lambda a, s, n, p, ps: paged_row(a, s, n, sorted(p), ps))  # pages reordered
    assert not ch04.check_paged_row(lambda *args: None)  # a stub


def test_ch04_freed_slots():
    assert ch04.check_freed_slots([12, 13, 14, 15, 0, 1, 2, 3])
    assert not ch04.check_freed_slots([12, 13, 14, 15, 0, 1, 2])  # page 0's unwritten slot is freed too
    assert not ch04.check_freed_slots([20, 21, 22, 23, 12, 13, 14, 15, 0, 1, 2, 3])  # A's page is A's
    assert not ch04.check_freed_slots(...)




def chunk_step(slots, start, end):
    positions = list(range(start, end))
    mask = torch.zeros(end - start, end, dtype=torch.bool)
    for i in range(end - start):
        mask[i, :start + i + 1] = True
    return positions, slots[start:end], mask


def test_ch05_chunk():
    assert ch05.check_chunk(chunk_step)
    assert not ch05.check_chunk(lambda s, a, b: (list(range(b - a)), s[a:b], chunk_step(s, a, b)[2]))  # restarts at 0
    assert not ch05.check_chunk(lambda s, a, b: (*chunk_step(s, a, b)[:2], torch.ones(b - a, b - a).tril().bool()))
    assert not ch05.check_chunk(lambda s, a, b: None)  # a stub
    assert not ch05.check_chunk(lambda s, a, b: 7)
