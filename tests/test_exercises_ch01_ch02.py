"""The chapter 1-2 checkers accept a right answer and refuse a wrong (or crashing) one."""

from kvlearn.exercises import ch01, ch02


def test_ch01_position(capsys):
    def right(table, bs, slot):
        return table.index(slot // bs) * bs + slot % bs if slot // bs in table else None

    assert ch01.check_position(right)
    assert not ch01.check_position(lambda table, bs, slot: slot)           # ignores the table
    assert not ch01.check_position(lambda table, bs, slot: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out


def test_ch01_waste():
    assert ch01.check_waste(lambda lengths, bs: sum(-(-n // bs) * bs - n for n in lengths))
    assert not ch01.check_waste(lambda lengths, bs: sum(bs - n % bs for n in lengths))  # full blocks waste bs


def test_ch02_divergence():
    assert ch02.check_divergence(4, [0, 2, 1])  # block 1 half matches: no hit; then the free page, then evict
    assert not ch02.check_divergence(6, [0, 2, 1])  # counted the matching tokens inside block 1
    assert not ch02.check_divergence(4, [0, 1, 2])  # kept A's block 1 as if shared
    assert not ch02.check_divergence(..., ...)  # a stub: "Not yet", no crash
