"""The chapter 4 and 5 checkers accept a right answer and refuse wrong ones."""

import torch

from kvlearn.exercises import ch04, ch05


def slots_for_budget(budget, layers, kv_heads, head_dim, dtype_bytes, page_size):
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    return budget // per_token // page_size * page_size


def test_ch04_slots_for_budget():
    assert ch04.check_slots_for_budget(slots_for_budget)
    assert not ch04.check_slots_for_budget(lambda b, l, h, d, n, p: b // (l * h * d * n))  # forgot V
    assert not ch04.check_slots_for_budget(lambda b, l, h, d, n, p: b // (2 * l * h * d * n))  # partial pages


def test_ch04_page_slots():
    assert ch04.check_page_slots(lambda pages, size: [p * size + i for p in pages for i in range(size)])
    assert not ch04.check_page_slots(lambda pages, size: [p * size + i for p in sorted(pages) for i in range(size)])
    assert not ch04.check_page_slots(lambda pages, size: 1 / 0)


def test_ch04_free_is_legal():
    def legal(flags, slots):
        return (all(0 <= s < len(flags) for s in slots) and len(set(slots)) == len(slots)
                and not any(flags[s] for s in slots))

    assert ch04.check_free_is_legal(legal)
    assert not ch04.check_free_is_legal(lambda flags, slots: all(0 <= s < len(flags) and not flags[s] for s in slots))


def positions_and_slots(query_lens, kv_indices):
    positions, slots = [], []
    for q, ctx in zip(query_lens, kv_indices):
        positions += range(len(ctx) - q, len(ctx))
        slots += ctx[len(ctx) - q:]
    return positions, slots


def build_mask(query_lens, kv_lens):
    mask = torch.zeros(len(query_lens), max(query_lens), max(kv_lens), dtype=torch.bool)
    for b, (q, n) in enumerate(zip(query_lens, kv_lens)):
        for i in range(q):
            mask[b, i, : n - q + i + 1] = True
    return mask


def test_ch05_positions_and_slots():
    assert ch05.check_positions_and_slots(positions_and_slots)
    assert not ch05.check_positions_and_slots(
        lambda q, kv: ([p for n in q for p in range(n)], [s for n, c in zip(q, kv) for s in c[:n]]))  # first tokens
    assert not ch05.check_positions_and_slots(lambda q, kv: 7)  # not a pair: "Not yet", not a crash


def test_ch05_mask():
    assert ch05.check_mask(build_mask)
    assert not ch05.check_mask(lambda q, n: torch.ones(len(q), max(q), max(n), dtype=torch.bool))
    assert not ch05.check_mask(lambda q, n: build_mask(q, n).tolist())


def test_ch05_tokens_to_compute():
    def to_compute(cached, prompt):
        common = 0
        while common < min(len(cached), len(prompt)) and cached[common] == prompt[common]:
            common += 1
        return len(prompt) - min(common, len(prompt) - 1)

    assert ch05.check_tokens_to_compute(to_compute)
    assert not ch05.check_tokens_to_compute(lambda cached, prompt: len(prompt) - sum(
        1 for a, b in zip(cached, prompt) if a == b))  # a full hit would compute nothing
