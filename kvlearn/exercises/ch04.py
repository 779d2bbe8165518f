"""Chapter 4 exercises: size a pool from a budget, slots of pages, when a free is legal."""

import torch

from kvlearn.exercises import attempt, report
from kvlearn.memory import KVConfig
from kvlearn.pool import KVPool


def check_slots_for_budget(slots_for_budget) -> bool:
    """Exercise 1: `slots_for_budget(budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes,
    page_size)` returns how many slots a pool of whole pages can have within the budget."""
    dtypes = {2: torch.bfloat16, 4: torch.float32}
    cases = [(1 << 30, 30, 3, 64, 4, 1), (1 << 30, 30, 3, 64, 2, 16), (10**9, 32, 8, 128, 2, 16),
             (46_080 * 17, 30, 3, 64, 4, 16), (123_456_789, 2, 1, 8, 4, 3)]
    for budget, layers, kv_heads, head_dim, nbytes, page in cases:
        cfg = KVConfig("case", "GQA", layers, kv_heads, kv_heads, head_dim)
        expected = KVPool.slots_for_budget(cfg, budget, dtypes[nbytes], page)
        got, error = attempt(slots_for_budget, budget, layers, kv_heads, head_dim, nbytes, page)
        if error or got != expected:
            return report(False, error or f"budget={budget}, layers={layers}, kv_heads={kv_heads}, head_dim="
                          f"{head_dim}, dtype_bytes={nbytes}, page_size={page}: expected {expected}, got {got}. "
                          "Bytes per token count K and V; then keep only whole pages.")
    return report(True, "")


def check_page_slots(page_slots) -> bool:
    """Exercise 2: `page_slots(pages, page_size)` returns the slot ids (a list) of these pages, in
    order, as `KVPool.alloc` hands them out."""
    for page_size in (1, 4, 16):
        pool = KVPool(1, 1, 1, 8 * page_size, page_size=page_size, device="cpu")
        held = pool.alloc(6 * page_size).reshape(6, page_size)
        for page in (4, 1, 3):  # freed pages are handed out again last-freed first: out of order
            pool.free(held[page])
        expected = pool.alloc(5 * page_size)
        pages = (expected[::page_size] // page_size).tolist()
        got, error = attempt(page_slots, pages, page_size)
        if error or not isinstance(got, (list, tuple)) or list(got) != expected.tolist():
            return report(False, error or f"pages={pages}, page_size={page_size}: expected "
                          f"{expected.tolist()}, got {got}. Page p starts at slot p * page_size.")
    return report(True, "")


def check_free_is_legal(free_is_legal) -> bool:
    """Exercise 3: `free_is_legal(free_flags, slots)` says whether `KVPool.free(slots)` (page_size 1)
    would accept these slots, given `free_flags[i]` = slot i is free now."""
    flags = [False, True, False, False, True, False]
    cases = [[0, 2], [1], [0, 0], [6], [-1], [], [3, 5, 2, 0], [5, 4]]
    for slots in cases:
        pool = KVPool(1, 1, 1, len(flags), device="cpu")
        held = pool.alloc(len(flags))
        pool.free(held[torch.tensor(flags)])
        try:
            pool.free(torch.tensor(slots, dtype=torch.int64))
            expected = True
        except ValueError:
            expected = False
        got, error = attempt(free_is_legal, list(flags), list(slots))
        if error or got != expected:
            return report(False, error or f"free_flags={flags}, slots={slots}: expected {expected}, got {got}. "
                          "Check the range, slots that are already free, and the same slot listed twice.")
    return report(True, "")
