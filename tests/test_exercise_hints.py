"""The exercise checkers' hints: each likely mistake of an exercise gets a hint of its own (listed
here, one phrase per mistake that only its hint holds), and when the learner's function raises, the
hint shows the inputs of the call, as it does for a wrong answer."""

import pytest
import torch

from kvlearn.exercises import NOT_YET, ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch10
from kvlearn.routing.policies import RoundRobin
from kvlearn.serving.workloads import unique_token_floor


def said(capsys, check, *args) -> str:
    """The checker's verdict line for a wrong answer (it must say Not yet, and return False)."""
    assert check(*args) is False
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith(NOT_YET), verdict
    return verdict


# --- the likely mistakes, per exercise: (the checker's arguments, a phrase only its hint holds) ---

def slot_of(table, bs, p):
    return table[p // bs] * bs + p % bs


def chunk_step(slots, start, end):
    mask = torch.ones(end - start, end, dtype=torch.bool).tril(start)
    return list(range(start, end)), slots[start:end], mask


def chunk_within(slots, start, end):   # causal inside the chunk, blind to the earlier chunks
    mask = torch.zeros(end - start, end, dtype=torch.bool)
    mask[:, start:] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return list(range(start, end)), slots[start:end], mask


def paged_row(a_row, shared, b_len, new_pages, page_size):
    reused = shared // page_size * page_size
    return a_row[:reused] + [p * page_size + i for p in new_pages for i in range(page_size)][:b_len - reused]


def relock_counts_wrong(cache, key, value, old_node):
    duplicates, match = cache.insert_prefix(key, value)
    cache.lock(match.last_node)
    cache.unlock(old_node)
    return match.last_node, duplicates + 1


def relock_unlock_first(cache, key, value, old_node):
    duplicates, match = cache.insert_prefix(key, value)
    cache.unlock(old_node)
    cache.lock(match.last_node)
    return match.last_node, duplicates


def relock_never_locks(cache, key, value, old_node):
    duplicates = cache.insert(key, value)
    cache.unlock(old_node)
    return cache.match_prefix(key).last_node, duplicates


def history_agree(cache):   # the leaf hit more is also the one used last: both policies take the other
    cache.insert([1, 2], torch.tensor([0, 1]))
    cache.insert([3, 4], torch.tensor([2, 3]))
    for key in ([3, 4], [1, 2], [1, 2]):
        cache.match_prefix(key)


def half_throughput():
    cost = ch00.reference_step()
    half = int(-(-cost.fixed_s // cost.per_seq_s))
    return [((1 / cost.per_seq_s, half - 1), "one more"), ((1 / cost.per_seq_s, half + 5), "round to the whole"),
            ((1 / cost.seconds(1), half), "tend to")]


def lfu_measured():
    trace = ch03.chat_trace()
    n = max(len(prompt) + len(answer) for prompt, answer in trace)
    lru, lfu = {n: ch03.reference_hit_rate(trace, n, "lru")}, {n: ch03.reference_hit_rate(trace, n, "lfu")}
    return [((lru, lfu, "a"), "system prompt"), ((lru, lfu, "c"), "not time"),
            ((lru, lru, "b"), "measure with hit_rate")]


MISTAKES = {
    "ch00 bytes per token": (ch00.check_bytes_per_token, lambda: [
        ((2 * 32 * 32 * 128 * 2,), "32 query heads"), ((32 * 8 * 128 * 2,), "K or V alone"),
        ((2 * 32 * 8 * 128 * 4,), "4 bytes per value"), ((2 * 8 * 128 * 2,), "one layer")]),
    "ch00 gpu batch": (ch00.check_gpu_batch, lambda: [
        ((2 * 989 / 3.35,), "2 bytes"), ((989 / 3.35 / 2,), "2 FLOPs"), ((16,), "Set them equal")]),
    "ch00 half throughput": (ch00.check_half_throughput, half_throughput),
    "ch01 position": (ch01.check_position, lambda: [
        ((lambda table, bs, slot: slot,), "A slot is not a position"),
        ((lambda table, bs, slot: slot_of(table, bs, slot) if slot // bs < len(table) else None,), "run forward"),
        ((lambda table, bs, slot: table.index(slot // bs) if slot // bs in table else None,), "place in the table"),
        ((lambda table, bs, slot: table.index(slot // bs) + slot % bs if slot // bs in table else None,),
         "covers block_size positions"),
        ((lambda table, bs, slot: table.index(slot // bs) * bs + slot % bs,), "return None")]),
    "ch01 waste": (ch01.check_waste, lambda: [
        ((lambda lengths, bs: sum(bs - n % bs for n in lengths),), "fills its last block"),
        ((lambda lengths, bs: sum(-(-n // bs) * bs for n in lengths),), "every slot allocated"),
        ((lambda lengths, bs: sum(-(-n // bs) for n in lengths),), "counts blocks")]),
    "ch02 divergence": (ch02.check_divergence, lambda: [
        ((6, [0, 2, 1]), "only half of it agrees"), ((8, [0, 2, 1]), "last two tokens"), ((0, [0, 2, 1]), "same hash"),
        ((4, [0, 1, 2]), "is not a hit"), ((4, [0, 2]), "three blocks")]),
    "ch03 relock": (ch03.check_relock, lambda: [
        ((relock_counts_wrong,), "already held 3"), ((relock_never_locks,), "exactly one lock"),
        ((relock_unlock_first,), "Which of lock and unlock must come first")]),
    "ch03 policies disagree": (ch03.check_policies_disagree, lambda: [
        ((lambda cache: None,), "takes nothing"), ((history_agree,), "both policies evict the leaf")]),
    "ch03 lfu measured": (ch03.check_lfu_measured, lfu_measured),
    "ch04 paged row": (ch04.check_paged_row, lambda: [
        ((lambda a, s, n, p, ps: a[:s] + [q * ps + i for q in p for i in range(ps)][:n - s],), "a page A is writing"),
        ((lambda a, s, n, p, ps: a[:s // ps * ps] + list(p),), "are page ids"),
        ((lambda a, s, n, p, ps: paged_row(a, s, n, sorted(p), ps),), "in the order given"),
        ((lambda a, s, n, p, ps: [q * ps + i for q in p for i in range(ps)][:n],), "shares its first tokens")]),
    "ch04 freed slots (slot ids vs page ids)": (ch04.check_freed_slots, lambda: [
        (([3, 0],), "those are page ids"),
        (([20, 21, 22, 23, 12, 13, 14, 15, 0, 1, 2],), "B's whole row"),
        (([12, 13, 14, 15, 0, 1, 2],), "never wrote goes back too"),
        (([20, 21, 22, 23, 12, 13, 14, 15, 0, 1, 2, 3],), "which still runs")]),
    "ch05 chunk": (ch05.check_chunk, lambda: [
        ((lambda s, a, b: (list(range(b - a)), *chunk_step(s, a, b)[1:]),), "keep their place"),
        ((lambda s, a, b: (list(range(a, b)), s[:b], chunk_step(s, a, b)[2]),), "whole context's slots"),
        ((lambda s, a, b: (*chunk_step(s, a, b)[:2], torch.ones(b - a, b - a).tril().bool()),),
         "[chunk tokens, context]"),
        ((chunk_within,), "earlier chunk's tokens too")]),
    "ch06 radix prefill": (ch06.check_radix_prefill, lambda: [
        ((lambda prompts: sum(map(len, prompts)),), "every prompt token"),
        ((unique_token_floor,), "That is the floor")]),
    "ch06 computed prefill": (ch06.check_computed_prefill, lambda: [
        ((26, 14), "radix: the first prompt"), ((12, 12), "blocks: only whole blocks")]),
    "ch07 policy": (ch07.check_policy, lambda: [
        ((lambda n: "not a policy",), "must return a kvlearn Policy"),
        ((lambda n: RoundRobin(),), "sessions were split")]),
    "ch08 host keeps": (ch08.check_host_keeps, lambda: [
        (({"write_back": {"C", "D", "E"}, "write_through": {"D", "E"}},), "host drop"),
        (({"write_back": set("BCDE"), "write_through": set("BCDE")},), "copied to the host"),
        ((...,), "answer with a dict")]),
    "ch08 crash survivors": (ch08.check_crash_survivors, lambda: [
        (({"write_back": set("AB"), "write_through": set("ABCDE")},), "leaves memory altogether"),
        (({"write_back": {"A"}, "write_through": set("DE")},), "can a crash come between"),
        ((None,), "answer with a dict")]),
    "ch10 int8 capacity": (ch10.check_int8_capacity, lambda: [
        ((ch10.BUDGET_BYTES // (2 * 32 * 8 * 128),), "forgets the scales"),
        ((ch10.BUDGET_BYTES // (2 * 32 * 8 * 128 * 2),), "bfloat16 pool"),
        ((ch10.BUDGET_BYTES // (2 * 32 * 8 * 128 + 2 * 32 * 4),), "one scale per layer"),
        ((ch10.BUDGET_BYTES // (32 * 8 * 132),), "K alone"), ((16 * 10 ** 9 // (2 * 32 * 8 * 132),), "16 GB"),
        ((1000,), "rounded down")]),
}
# Exercises whose checker simulates (chapter 6's theorem, chapter 7's) list their mistakes where their
# tests already run them: tests/test_exercises_ch06.py and tests/test_routing_exercises.py (own_hints).


def own_hints(capsys, check, mistakes) -> None:
    """Each (arguments, phrase) of `mistakes` gets a Not yet whose hint holds its phrase and no other's."""
    assert len(mistakes) >= 2
    phrases = [phrase for _, phrase in mistakes]
    for args, phrase in mistakes:
        message = said(capsys, check, *args)
        assert phrase in message, f"{check.__name__}: the hint for {args!r} should say {phrase!r}: {message}"
        others = [p for p in phrases if p != phrase and p in message]
        assert not others, f"{check.__name__}: the hint for {args!r} also holds {others} (another mistake's): {message}"


@pytest.mark.parametrize("exercise", MISTAKES)
def test_each_likely_mistake_gets_a_hint_of_its_own(exercise, capsys):
    check, make = MISTAKES[exercise]
    own_hints(capsys, check, make())


# --- a function that raises: the hint shows the call's inputs ------------------------------------

def boom(*args):
    raise RuntimeError("boom")


RAISES = [   # (checker, the inputs its hint must show)
    (ch01.check_position, "block_table=[2, 3, 4], block_size=4, slot=0"),
    (ch01.check_waste, "lengths=[1], block_size=16"),
    (ch03.check_relock, "key=[1, 2, 3, 4, 5], value=tensor([20, 21, 22, 23, 24])"),
    (ch03.check_policies_disagree, "on an empty RadixCache(eviction_policy='lru')"),
    (ch04.check_paged_row, "a_row=[20, 21, 22, 23, 8, 9, 10, 11, 28, 29], shared=6, b_len=11, new_pages=[3, 0]"),
    (ch05.check_chunk, "slots=[7, 8, 9, 3, 4, 5, 6], start=0, end=4"),
    (ch06.check_radix_prefill, "prompts=[[1, 2, 3], [1, 2, 3]]"),
    (ch07.check_policy, "num_replicas=6"),
    (ch07.check_routing_share, "trace=the first 200 requests of section 4's trace, replicas=4, slots=3072"),
]


@pytest.mark.parametrize("check, inputs", RAISES, ids=[c.__module__[-4:] + "." + c.__name__ for c, _ in RAISES])
def test_a_function_that_raises_gets_the_inputs_of_the_call(check, inputs, capsys):
    message = said(capsys, check, boom)
    assert inputs in message and "your function raised RuntimeError: boom" in message, message


def test_a_raise_on_a_slot_outside_the_table_is_told_to_return_none(capsys):
    message = said(capsys, ch01.check_position, lambda table, bs, slot: table.index(slot // bs) * bs + slot % bs)
    assert message == (f"{NOT_YET} block_table=[2, 3, 4], block_size=4, slot=0: your function raised ValueError: 0 is "
                       "not in list. The slot's block 0 is not in the table: return None.")
