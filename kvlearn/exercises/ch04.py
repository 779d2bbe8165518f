"""Chapter 4 exercises: a paged req_to_token row after a partial hit, and what its owner frees. (The
chapter's build exercise, your own page allocator, is judged by `kvlearn.parts.check("allocator", ...)`.)"""

from kvlearn.exercises import attempt, given, likely_mistake, report


def _expected_row(a_row, shared, b_len, new_pages, page_size):
    reused = shared // page_size * page_size  # whole pages only: the rest of a page is A's to write
    fresh = [p * page_size + i for p in new_pages for i in range(page_size)]
    return list(a_row[:reused]) + fresh[:b_len - reused]


# (A's row, tokens B shares with A, B's length, pages handed out for B, page size)
ROW_CASES = [([20, 21, 22, 23, 8, 9, 10, 11, 28, 29], 6, 11, [3, 0], 4),
             ([20, 21, 22, 23, 8, 9, 10, 11, 28, 29], 8, 9, [6], 4),
             ([4, 5, 6, 7, 0, 1], 3, 5, [3, 2], 2),
             ([12, 13, 14, 15], 2, 4, [0], 4),
             ([7, 3, 9], 2, 4, [1, 5], 1)]


def check_paged_row(paged_row) -> bool:
    """Exercise 1: `paged_row(a_row, shared, b_len, new_pages, page_size)` returns request B's
    req_to_token row (a list of slots): B agrees with request A (whose row is `a_row`) on its first
    `shared` tokens, the paged cache lets B borrow A's slots for whole pages only, and B's other
    tokens go to the pages `new_pages`, in order."""
    for a_row, shared, b_len, new_pages, page_size in ROW_CASES:
        want = _expected_row(a_row, shared, b_len, new_pages, page_size)
        shown = given(a_row=a_row, shared=shared, b_len=b_len, new_pages=new_pages, page_size=page_size)
        got, error = attempt(paged_row, list(a_row), shared, b_len, list(new_pages), page_size, shown=shown)
        row, _ = attempt(lambda got=got: [int(s) for s in got], shown=shown)
        if error or row != want:
            reused = shared // page_size * page_size
            fresh = [p * page_size + i for p in new_pages for i in range(page_size)]
            mistakes = [
                (a_row[:shared] + fresh[:b_len - shared], "B may borrow A's slots only for whole pages: the rest of "
                                                         "a page A is writing belongs to A."),
                (a_row[:reused] + list(new_pages), "New_pages are page ids: B's tokens go to their slots, page p "
                                                   "holding slots p * page_size onwards."),
                (_expected_row(a_row, shared, b_len, sorted(new_pages), page_size), "Take the new pages in the "
                                                                                    "order given, not sorted."),
                (fresh[:b_len], "B shares its first tokens with A: borrow A's slots for the whole pages they fill.")]
            return report(False, error or f"{shown}: expected {want}, got {got}. " + (
                likely_mistake(row, mistakes) or "B may borrow A's slots only for whole pages (the rest of a page "
                                                  "belongs to A); page p holds slots p * page_size onwards."))
    return report(True, "")


def check_freed_slots(answer) -> bool:
    """Exercise 2: request B of exercise 1's first case (ROW_CASES[0]) finishes while A still runs.
    Which slots does B give back to the pool (a list, in any order)?"""
    a_row, shared, b_len, new_pages, page_size = ROW_CASES[0]
    want = sorted(p * page_size + i for p in new_pages for i in range(page_size))
    b_row = _expected_row(a_row, shared, b_len, new_pages, page_size)
    got, _ = attempt(lambda: sorted(int(s) for s in answer), shown="")
    return report(got == want, likely_mistake(got, [
        (sorted(new_pages), "those are page ids: the pool takes back slots, page p holding slots p * page_size "
                            "onwards."),
        (sorted(b_row), "that is B's whole row: the slots it borrowed stay with A, and its last page goes back whole, "
                        "the slot B never wrote included."),
        (sorted(b_row[shared // page_size * page_size:]), "the pool takes pages back whole: the slot of B's last "
                                                          "page that B never wrote goes back too."),
        (sorted(set(want) | set(b_row)), "the slots B borrowed stay with A, which still runs.")]) or
        "B frees only what it owns: borrowed slots stay with A, and the pool takes pages back "
        "whole, the slot B never wrote included.")
