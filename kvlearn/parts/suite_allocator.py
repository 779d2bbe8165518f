"""The conformance suite of the `allocator` part (chapter 4), judged by a set of free pages.

A program is a page count and random operations: alloc (some that fit, some one page too many),
free of part or all of an earlier alloc, and a double free (a page already free, alone or next to
one that is held). After every call the part's free pages must be the reference's.
"""

from __future__ import annotations

import random

import torch

from kvlearn.errors import KVCapacityError
from kvlearn.parts.trace import Broken, Trace, ints, number, same

HINTS = {
    "alloc": "alloc(n) hands out the first n pages of free_pages, in that order, and they stop being free "
             "(chapter 4: the free list is a stack; a page freed last is handed out first).",
    "capacity": "alloc(n) with fewer than n free pages raises kvlearn.KVCapacityError and takes nothing: "
                "check before you change anything.",
    "free": "free(pages) puts each page back on the free list, once.",
    "double": "freeing a page that is already free raises ValueError and frees nothing, not even the other "
              "pages of that call: check every page first, then change the free list.",
    "state": "num_free, free_pages and is_free must agree with what alloc and free did: a page is free "
             "exactly when it was freed after it was last handed out.",
}


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"num_pages": rng.randint(1, 12)}
    ops = [(rng.choice(["alloc", "alloc", "free", "free", "too_many", "double_free"]), rng.randrange(1 << 16))
           for _ in range(rng.randint(1, 25))]
    return setup, ops


def build(impl, setup: dict, trace: Trace):
    return trace.call(f"allocator = {impl.__name__}({setup['num_pages']}, device='cpu')",
                      impl, setup["num_pages"], device="cpu")


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    n_pages = setup["num_pages"]
    allocator = build(impl, setup, trace)
    free = set(range(n_pages))
    held: list[list[int]] = []   # what each alloc handed out, less what was freed since
    for trace.op, (op, r) in enumerate(ops):
        rng = random.Random(r)
        if op == "alloc" and free:
            n = rng.randint(0, len(free))
            order = list(trace.call("allocator.free_pages", lambda: allocator.free_pages, quiet=True))
            got = ints(f"alloc({n})", trace.call(f"allocator.alloc({n})", allocator.alloc, n))
            trace.answer(str(got))
            same(f"alloc({n}) with free_pages {order}", order[:n], got, HINTS["alloc"])
            free -= set(got)
            held.append(got)
        elif op == "too_many":
            n = len(free) + 1
            trace.refused(f"allocator.alloc({n})   # {len(free)} free", (KVCapacityError,), allocator.alloc, n,
                          hint=HINTS["capacity"])
        elif op == "free" and any(held):
            pages = rng.choice([h for h in held if h])
            give = sorted(rng.sample(pages, rng.randint(1, len(pages))))
            trace.call(f"allocator.free(torch.tensor({give}))", allocator.free, torch.tensor(give))
            for p in give:
                pages.remove(p)
            free |= set(give)
        elif op == "double_free" and free:
            again = [rng.choice(sorted(free))]
            busy = [p for h in held for p in h]
            if busy and rng.random() < 0.5:
                again = [rng.choice(busy)] + again
            trace.refused(f"allocator.free(torch.tensor({again}))   # page {again[-1]} is free",
                          (ValueError,), allocator.free, torch.tensor(again), hint=HINTS["double"])
        else:
            continue
        check_state(allocator, free, n_pages, trace)


def check_state(allocator, free: set, n_pages: int, trace: Trace) -> None:
    got = number("num_free", trace.call("allocator.num_free", lambda: allocator.num_free, quiet=True))
    same("num_free", len(free), got, HINTS["state"])
    pages = list(trace.call("allocator.free_pages", lambda: allocator.free_pages, quiet=True))
    same("free_pages (sorted)", sorted(free), sorted(pages), HINTS["state"])
    everything = torch.arange(n_pages)
    flags = trace.call("allocator.is_free(torch.arange(num_pages))", allocator.is_free, everything, quiet=True)
    if not isinstance(flags, torch.Tensor) or flags.shape != everything.shape:
        raise Broken(f"is_free must return a bool tensor of one flag per page, got {flags!r}", HINTS["state"])
    same("the pages is_free says are free", sorted(free), everything[flags.bool()].tolist(), HINTS["state"])
