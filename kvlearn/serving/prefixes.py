"""Shared prefixes of token sequences: how long two prompts agree, and how many distinct prefixes
a set of prompts holds (the unique-token floor). Chapter 6's workloads and in-batch prefix check and
chapter 7's traces and fleet count with these; chapter 3's radix tree keeps its own page-aligned
match inside an edge.
"""

from __future__ import annotations


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of the sequences `a` and `b` (lists or tuples). The first
    mismatch is found by bisection on slice equality, which compares in C: no Python step per token."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n   # a[:lo] == b[:lo] and the first mismatch is before n: the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def unique_token_floor(prompts) -> int:
    """Number of distinct token prefixes across `prompts` (the node count of their trie): no cache
    computes fewer prompt tokens, unless a prompt contains tokens an earlier request generated
    (their KV was computed during decode; the course's workloads fix every prompt, answers
    included, in advance; chapter 7's `routing.traces.unique_token_floor` takes those out).

    Sorted order puts the prompt sharing the longest prefix with p right before p, so each prompt
    adds exactly `len(p) - common_prefix_len(p, previous)` new prefixes; duplicates add none.
    """
    floor, previous = 0, ()
    for prompt in sorted({tuple(p) for p in prompts}):
        floor += len(prompt) - common_prefix_len(prompt, previous)
        previous = prompt
    return floor
