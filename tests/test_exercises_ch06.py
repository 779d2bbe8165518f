"""The chapter 6 checkers added by the teaching pass accept a right answer and refuse wrong ones."""

import pytest

from kvlearn.exercises import ch06
from kvlearn.serving.workloads import unique_token_floor
from tests.test_exercise_hints import own_hints


def radix_prefill(prompts):
    repeats = sum(any(earlier[:len(p)] == p for earlier in prompts[:i]) for i, p in enumerate(prompts))
    return unique_token_floor(prompts) + repeats


def test_radix_prefill():
    assert ch06.check_radix_prefill(radix_prefill)
    assert not ch06.check_radix_prefill(unique_token_floor)  # the floor alone misses the recomputed last tokens
    assert not ch06.check_radix_prefill(lambda prompts: None)  # a stub
    assert not ch06.check_radix_prefill(lambda prompts: 1 / 0)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_theorem(capsys):
    from kvlearn.serving.simulate import simulate

    few_shot = ch06.theorem_workload()
    measure = {n: {s: simulate(few_shot, "radix", max_new_tokens=n, num_slots=320, schedule=s)
                   for s in ("fcfs", "lpm")} for n in (1, 16)}
    computed = {s: measure[1][s]["computed_prefill_tokens"] for s in ("fcfs", "lpm")}
    preempted = {s: measure[16][s]["preemptions"] for s in ("fcfs", "lpm")}
    assert computed["lpm"] <= computed["fcfs"] and preempted["lpm"] > preempted["fcfs"]  # the lesson holds
    longest = max(len(p) + 15 for p in few_shot.prompt_lists())
    assert longest <= 320                                       # so (b) holds: the pool fits the longest
    assert ch06.check_theorem(longest, computed, preempted, "c")
    own_hints(capsys, ch06.check_theorem, [   # each likely mistake, a hint of its own
        ((longest, computed, preempted, "a"), "depth-first order still pays"),
        ((longest, computed, preempted, "b"), "under the pool's 320"),
        ((longest - 1, computed, preempted, "c"), "every output token but the last"),   # the last token needs no slot
        # the 16-token counts
        ((longest, {"fcfs": 551, "lpm": 630}, preempted, "c"), "measure computed_prefill_tokens"),
        ((longest, computed, {"fcfs": 0, "lpm": 0}, "c"), "stats['preemptions']")])
    assert not ch06.check_theorem(..., ..., ..., ...)  # the stubs


def test_computed_prefill():
    # by hand: radix computes 9 + 2 + 1 (the floor); blocks of 4 share [1-4][5-8] with the second
    # prompt and only [1-4] with the third (its last token sits in block 2): 9 + 2 + 3
    assert ch06.check_computed_prefill(radix=12, blocks=14)
    assert not ch06.check_computed_prefill(radix=12, blocks=12)
    assert not ch06.check_computed_prefill(radix=26, blocks=14)
