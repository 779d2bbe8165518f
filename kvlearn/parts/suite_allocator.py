"""The conformance suite of the `allocator` part (chapter 4), judged by an ordered free list.

A program is a page count (one in 20 has more than 256, and there allocs and frees are often whole,
so that a free call gives back more than 256 pages) and random operations: alloc (some that fit,
some one page too many, some of a negative count), free of part or all of an earlier alloc (in a
random order), a double free (a page already free, alone or next to one that is held), a free that
lists a held page twice, and a free of a page outside 0 .. num_pages - 1. After every call the
part's free pages must be the reference's, in the reference's order: a stack, so a fresh allocator
hands out 0, 1, 2, ..., `alloc(n)` takes the first n of `free_pages`, and `free(pages)` puts them
back in front, `pages[0]` first.
"""

from __future__ import annotations

import random

import torch

from kvlearn.errors import KVCapacityError
from kvlearn.parts.allocator import AllocatorPart
from kvlearn.parts.judge import Broken, Trace, ints, number, same

CONTRACT = AllocatorPart

HINTS = {
    "alloc": "alloc(n) hands out the first n pages of free_pages, in that order, and they stop being free "
             "(chapter 4: the free list is a stack; a page freed last is handed out first).",
    "capacity": "alloc(n) with fewer than n free pages raises kvlearn.KVCapacityError and takes nothing: "
                "check before you change anything.",
    "negative": "alloc(n) refuses a negative n (ValueError) and changes nothing: alloc(-1) would move the top of "
                "the stack up and count a page free that nobody gave back (check n >= 0 first).",
    "free": "free(pages) puts each page back on the free list, once.",
    "order": "free(pages) puts the pages back on top of the stack, pages[0] on top: free_pages then starts "
             "with pages in the order given, and pages[0] is handed out first next time (chapter 4: push them "
             "reversed, pages.flip(0)).",
    "fresh": "a fresh allocator hands out its pages as 0, 1, 2, ...: free_pages is [0, 1, ..., num_pages - 1].",
    "double": "freeing a page that is already free raises ValueError and frees nothing, not even the other "
              "pages of that call: check every page first, then change the free list.",
    "repeat": "free refuses a page listed twice in one call (ValueError) and frees nothing: the page would go on "
              "the free list twice and be handed out to two callers (check pages.unique() first).",
    "range": "free refuses a page outside 0 .. num_pages - 1 (ValueError) and frees nothing: a negative id would "
             "index a tensor from its end, a large one raise IndexError (check the range first).",
    "state": "num_free, free_pages and is_free must agree with what alloc and free did: a page is free "
             "exactly when it was freed after it was last handed out.",
}


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"num_pages": rng.randint(1, 12)}
    kinds = ["alloc", "alloc", "free", "free", "too_many", "double_free", "repeat", "out_of_range"]
    ops = [(rng.choice(kinds), rng.randrange(1 << 16))
           for _ in range(rng.randint(1, 25))]
    if ops[0][1] % 20 == 0:   # one program in 20 has more than 256 pages (decided by a number drawn already,
        setup["num_pages"] += 256   # so that the other programs are the ones drawn before these came in)
    return setup, ops


def build(impl, setup: dict, trace: Trace):
    return trace.call(f"allocator = {impl.__name__}({setup['num_pages']}, device='cpu')",
                      impl, setup["num_pages"], device="cpu")


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    n_pages = setup["num_pages"]
    big = n_pages > 256   # then allocs and frees are often whole, so that one free gives back > 256 pages
    allocator = build(impl, setup, trace)
    free = list(range(n_pages))   # the reference: free pages, the next one handed out first
    held: list[list[int]] = []   # what each alloc handed out, less what was freed since
    check_state(allocator, free, n_pages, trace, HINTS["fresh"])
    for trace.op, (op, r) in enumerate(ops):
        rng = random.Random(r)
        busy = [p for h in held for p in h]
        order_hint = state_hint = HINTS["state"]   # a refused call changes nothing, order included
        if op == "alloc" and free:
            n = len(free) if big and rng.random() < 0.5 else rng.randint(0, len(free))
            got = ints(f"alloc({n})", trace.call(f"allocator.alloc({n})", allocator.alloc, n))
            trace.answer(str(got))
            same(f"alloc({n}) with free_pages {free}", free[:n], got, HINTS["alloc"])
            free = free[n:]
            held.append(got)
        elif op == "too_many" and rng.random() < 0.25:   # a negative count, drawn from this op's own seed
            n = -rng.choice([1, 1, 2, n_pages + 1])
            trace.refused(f"allocator.alloc({n})", (ValueError,), allocator.alloc, n, hint=HINTS["negative"])
            order_hint = state_hint = HINTS["negative"]
        elif op == "too_many":
            n = len(free) + 1
            trace.refused(f"allocator.alloc({n})   # {len(free)} free", (KVCapacityError,), allocator.alloc, n,
                          hint=HINTS["capacity"])
        elif op == "free" and busy:
            pages = rng.choice([h for h in held if h])
            give = rng.sample(pages, len(pages) if big and rng.random() < 0.5 else rng.randint(1, len(pages)))
            trace.call(f"allocator.free(torch.tensor({give}))", allocator.free, torch.tensor(give))
            for p in give:
                pages.remove(p)
            free = give + free
            order_hint = HINTS["order"]
        elif op == "double_free" and free:
            again = [rng.choice(sorted(free))]
            if busy and rng.random() < 0.5:
                again = [rng.choice(busy)] + again
            trace.refused(f"allocator.free(torch.tensor({again}))   # page {again[-1]} is free",
                          (ValueError,), allocator.free, torch.tensor(again), hint=HINTS["double"])
        elif op == "repeat" and busy:
            twice = rng.choice(busy)
            others = [p for p in busy if p != twice]
            pages = rng.sample(others, rng.randint(0, min(2, len(others)))) + [twice, twice]
            rng.shuffle(pages)
            trace.refused(f"allocator.free(torch.tensor({pages}))   # page {twice} twice", (ValueError,),
                          allocator.free, torch.tensor(pages), hint=HINTS["repeat"])
        elif op == "out_of_range":
            bad = rng.choice([-1, -n_pages, n_pages, n_pages + rng.randint(1, 3)])
            pages = rng.sample(busy, rng.randint(0, min(2, len(busy)))) + [bad]
            rng.shuffle(pages)
            trace.refused(f"allocator.free(torch.tensor({pages}))   # page {bad} does not exist", (ValueError,),
                          allocator.free, torch.tensor(pages), hint=HINTS["range"])
        else:
            continue
        check_state(allocator, free, n_pages, trace, order_hint, state_hint)


def check_state(allocator, free: list[int], n_pages: int, trace: Trace, order_hint: str,
                state_hint: str = HINTS["state"]) -> None:
    """The part's free pages against the reference's `free`: how many, which, then in what order
    (`order_hint`: the rule that set the order last; `state_hint`: the rule for the rest, the
    refusal's own after a call that must change nothing)."""
    got = number("num_free", trace.call("allocator.num_free", lambda: allocator.num_free, quiet=True))
    same("num_free", len(free), got, state_hint)
    pages = list(trace.call("allocator.free_pages", lambda: allocator.free_pages, quiet=True))
    same("free_pages (sorted)", sorted(free), sorted(pages), state_hint)
    same("free_pages (the order alloc hands them out)", free, pages, order_hint)
    everything = torch.arange(n_pages)
    flags = trace.call("allocator.is_free(torch.arange(num_pages))", allocator.is_free, everything, quiet=True)
    if not isinstance(flags, torch.Tensor) or flags.shape != everything.shape:
        raise Broken(f"is_free must return a bool tensor of one flag per page, got {flags!r}", HINTS["state"])
    same("the pages is_free says are free", sorted(free), everything[flags.bool()].tolist(), state_hint)
