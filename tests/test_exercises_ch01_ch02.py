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


def test_ch01_new_block_steps():
    assert ch01.check_new_block_steps([4, 8])
    assert not ch01.check_new_block_steps([3, 7])
    assert not ch01.check_new_block_steps("4, 8")


def test_ch02_cached_tokens():
    def right(cached_prompts, new_prompt, bs):
        best = 0
        for old in cached_prompts:
            k = 0
            limit = min(len(old), len(new_prompt) - 1)  # the last new token is always computed
            while (k + 1) * bs <= limit and old[:(k + 1) * bs] == new_prompt[:(k + 1) * bs]:
                k += 1
            best = max(best, k * bs)
        return best

    def no_last_token_rule(cached_prompts, new_prompt, bs):
        return right(cached_prompts, new_prompt + [None], bs)

    assert ch02.check_cached_tokens(right)
    assert not ch02.check_cached_tokens(no_last_token_rule)
    assert not ch02.check_cached_tokens(lambda c, n, bs: len(n) - 1)


def test_ch02_divergence_and_reused_block():
    assert ch02.check_divergence(4, [0, 2, 1])  # block 1 half matches: no hit; then the free page, then evict
    assert not ch02.check_divergence(6, [0, 2, 1])  # counted the matching tokens inside block 1
    assert not ch02.check_divergence(4, [0, 1, 2])  # kept A's block 1 as if shared
    assert not ch02.check_divergence(..., ...)  # a stub: "Not yet", no crash
    assert ch02.check_reused_block([3, 1, 0])  # the free page first, then X's blocks, freed longest ago
    assert not ch02.check_reused_block([3, 0, 1])
    assert not ch02.check_reused_block(3)
