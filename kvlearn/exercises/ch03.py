"""Chapter 3 exercises: page-aligned matching, predicting LRU eviction, and the engine's re-lock."""

import random

import torch

from kvlearn.exercises import attempt, report
from kvlearn.radix import RadixCache


def check_page_match(fn) -> bool:
    """Exercise 1: `fn(cached, query, page_size) -> int`, the number of tokens of `query` that a
    RadixCache(page_size) holding only `cached` (a list of token ids) returns from match_prefix."""
    rng = random.Random(3)
    cases = [([1, 2, 3, 4], [1, 2, 3, 9], 2), ([1, 2, 3], [1, 2, 3], 2), ([5, 6], [5], 1), ([], [1], 1)]
    cases += [([rng.randrange(3) for _ in range(rng.randrange(12))],
               [rng.randrange(3) for _ in range(rng.randrange(12))], rng.choice([1, 2, 3, 4])) for _ in range(300)]
    for cached, query, page in cases:
        cache = RadixCache(page_size=page)
        cache.insert(cached, torch.arange(len(cached)))
        expected = len(cache.match_prefix(query))
        got, error = attempt(fn, list(cached), list(query), page)
        if error or got != expected:
            return report(False, error or f"for cached={cached}, query={query}, page_size={page} the tree "
                          f"matches {expected} tokens, you said {got}. Only whole pages of the query count, "
                          "and a page counts only if all of its tokens match.")
    return report(True, "")


def _random_tree(seed: int) -> tuple[RadixCache, list]:
    """A small tree from seeded inserts and matches, with one path locked."""
    rng = random.Random(seed)
    cache = RadixCache()
    keys = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    for i, key in enumerate(keys):
        cache.insert(key, torch.arange(len(key)) + 100 * i)
        cache.match_prefix(rng.choice(keys[:i + 1]))
    cache.lock(cache.match_prefix(rng.choice(keys)).last_node)
    return cache, keys


def _evicted_ids(cache: RadixCache, num_tokens: int) -> list[int]:
    """Ids of the nodes `cache.evict(num_tokens)` removes, in order (this changes the cache)."""
    by_slot = {int(n.value[0]): n.id for n in cache.nodes()[1:]}
    order = []
    cache.evict_callback = lambda value: order.append(by_slot[int(value[0])])
    cache.evict(num_tokens)
    return order


def check_eviction_order(fn) -> bool:
    """Exercise 2: `fn(cache, num_tokens) -> list[int]`, the ids of the nodes that
    `cache.evict(num_tokens)` would remove, in the order it removes them, without changing `cache`."""
    from kvlearn.viz import radix_text

    for seed in range(40):
        for num_tokens in (1, 5, 40):
            cache, _ = _random_tree(seed)
            before = radix_text(cache)
            got, error = attempt(fn, cache, num_tokens)
            if error or not isinstance(got, (list, tuple)):
                return report(False, error or f"return a list of node ids, got {got!r}.")
            if radix_text(cache) != before:
                return report(False, "your function changed the tree: work on copies of what you read "
                                     "(node ids, last_access, lock_ref), never call evict.")
            expected = _evicted_ids(_random_tree(seed)[0], num_tokens)
            if list(got) != expected:
                return report(False, f"seed {seed}, evict({num_tokens}): expected nodes {expected}, got {list(got)}. "
                                     "Candidates are unlocked leaves, oldest (last_access, then id) first; "
                                     "whole leaves go; a parent whose last child went becomes a candidate.")
    return report(True, "")


class EagerEvictionCache(RadixCache):
    """A cache where an eviction runs inside every unlock, as one could between two calls if another
    thread (or an allocation) shared the cache: whatever is evictable after the unlock is evicted."""

    def unlock(self, node) -> None:
        super().unlock(node)
        self.evict(self.evictable_size)


def _relock_problems(fn, cache_type) -> list[str]:
    cache = cache_type()
    cache.insert([1, 2, 3], torch.tensor([0, 1, 2]))
    cache.insert([1, 2, 7, 7], torch.tensor([0, 1, 8, 9]))
    old = cache.match_prefix([1, 2, 3]).last_node
    cache.lock(old)
    key, value = [1, 2, 3, 4, 5], torch.tensor([20, 21, 22, 23, 24])
    answer, error = attempt(fn, cache, key, value, old)
    if error or not (isinstance(answer, tuple) and len(answer) == 2):
        return [error or f"return a pair (node, duplicates), got {answer!r}"]
    node, duplicates = answer
    problems = []
    if duplicates != 3:
        problems.append(f"the tree already held 3 of those tokens, you returned {duplicates}")
    if cache.protected_size != len(key) or cache.root.lock_ref != 1:
        problems.append(f"exactly one lock covering all {len(key)} tokens should remain (protected_size is "
                        f"{cache.protected_size}, root lock_ref {cache.root.lock_ref})")
        return problems
    if cache.match_len(key) != len(key) or cache.match_prefix(key).last_node is not node:
        problems.append("the node returned should be where `key` ends in the tree")
    elif cache.match_prefix(key).indices.tolist() != [0, 1, 2, 23, 24]:
        problems.append("the cached slots should be the tree's old ones followed by your new ones")
    return problems


def check_relock(fn) -> bool:
    """Exercise 3: `fn(cache, key, value, old_node) -> (node, duplicates)` does what an engine does
    when a request that held `old_node` locked has computed `key` (slots `value`) and goes on
    running: insert it, keep the whole of `key` locked through the returned node, release
    `old_node`, and return how many leading slots of `value` the tree already had (to be freed).
    Checked on a plain RadixCache, and on one where an eviction runs inside every unlock."""
    plain = _relock_problems(fn, RadixCache)
    if plain:
        return report(False, "; ".join(plain) + ". Hint: insert_prefix returns the duplicates and the node to lock.")
    eager = _relock_problems(fn, EagerEvictionCache)
    return report(not eager, "right on a plain cache, but when an eviction can run between two calls, "
                             "something you still need was evicted (" + "; ".join(eager) + "). Which of "
                             "lock and unlock must come first for the shared prefix to stay protected?")
