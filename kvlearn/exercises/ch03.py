"""Chapter 3 exercises: page-aligned matching, predicting LRU eviction, the engine's re-lock, and an
eviction policy of your own (LFU), measured on multi-turn chat against LRU."""

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


def _lfu_wrong_answers() -> dict:
    """Keys a learner may write instead of LFU's, each with what it gets wrong."""
    return {
        "LRU's key (last_access alone): count the hits too, as the first part of the key": lambda n: n.last_access,
        "the smallest key goes first: give the fewest hits the smallest key": lambda n: (-n.hits, n.last_access),
        "ties: among leaves with as many hits, the least recently used should go first (hits alone "
        "leaves the tie to the node id, i.e. to age, not to use)": lambda n: n.hits,
    }


def _policy_evictions(key, seed: int) -> list[int]:
    """Ids of the nodes a RadixCache with this eviction key evicts, in order, on a seeded random
    history of inserts, matches (each counts a hit on its path), locks and evictions."""
    rng = random.Random(seed)
    order = []
    cache = RadixCache(eviction_policy=key)
    by_slot = {}
    cache.evict_callback = lambda value: order.append(by_slot[int(value[0])])
    keys, locked, next_slot = [], [], 0
    for step in range(60):
        key_ = [rng.randrange(3) for _ in range(rng.randint(1, 7))]
        if step < 10 or rng.random() < 0.3:
            cache.insert(key_, torch.arange(next_slot, next_slot + len(key_)))
            next_slot += len(key_)
            keys.append(key_)
        elif rng.random() < 0.8:
            m = cache.match_prefix(rng.choice(keys)[:rng.randint(1, 7)])
            if rng.random() < 0.2:
                cache.lock(m.last_node)
                locked.append(m.last_node)
        elif locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        by_slot.update({int(n.value[0]): n.id for n in cache.nodes()[1:]})  # splits make new nodes
        if step % 10 == 9:
            cache.evict(rng.randint(1, 6))
    cache.evict(cache.evictable_size)
    return order


def check_lfu_key(fn) -> bool:
    """Exercise 4: `fn(node) -> key`, the eviction key of least-frequently-used eviction as SGLang
    defines it: the leaf with the fewest hits goes first, the least recently used among equals.
    Checked by the evictions of `RadixCache(eviction_policy=fn)` against the built-in "lfu"."""
    wrong = _lfu_wrong_answers()
    for seed in range(30):
        want = _policy_evictions("lfu", seed)
        got, error = attempt(_policy_evictions, fn, seed)
        if error or got != want:
            if error:
                return report(False, f"{error}. Return something comparable: a number or a tuple of numbers.")
            hint = next((h for h, key in wrong.items() if got == _policy_evictions(key, seed)),
                        "build the key from node.hits and node.last_access; the smallest key is evicted first.")
            at = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
            mine, lfu = (ids[at] if at < len(ids) else "none" for ids in (got, want))
            return report(False, f"seed {seed}: eviction {at + 1} took node #{mine} with your key, LFU takes "
                                 f"#{lfu}. Hint: {hint}")
    return report(True, "")


def chat_trace(num_conversations: int = 40, open_at_once: int = 4, seed: int = 0, vocab: int = 30_000) -> list:
    """Exercise 5's traffic: multi-turn chats as (prompt, answer) token-id lists, in arrival order.

    Every conversation starts with the same 40-token system prompt. `open_at_once` conversations are
    open at a time; the next turn comes from one of them at random, and a conversation that has had
    its turns (1 to 8) closes and a new one opens. Each turn's prompt is the whole conversation so
    far (system prompt, earlier questions and answers) plus a new question of 10-30 tokens; its
    answer has 20-60. Token ids are random: only which prompts share which prefixes matters here."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(40)]
    lengths = [rng.choice([1, 1, 2, 3, 4, 6, 8]) for _ in range(num_conversations)]
    waiting, open_, trace = list(range(num_conversations)), {}, []
    while waiting or open_:
        while len(open_) < open_at_once and waiting:
            c = waiting.pop(0)
            open_[c] = [list(system), lengths[c]]  # history so far, turns left
        c = rng.choice(sorted(open_))
        history, left = open_[c]
        prompt = history + [rng.randrange(vocab) for _ in range(rng.randint(10, 30))]
        answer = [rng.randrange(vocab) for _ in range(rng.randint(20, 60))]
        trace.append((prompt, answer))
        open_[c] = [prompt + answer, left - 1]
        if left == 1:
            del open_[c]
    return trace


def _hit_rate(trace, num_slots: int, policy) -> float:
    """Reference for exercise 5, the notebook's `hit_rate`: per turn, match all but the last prompt
    token, lock, take slots for the rest and the answer (evicting when the pool is short), insert
    prompt + answer, give back the slots of tokens the tree already had, unlock. Returns the share
    of prompt tokens taken from the cache."""
    pool = {"free": num_slots}

    def give_back(slots):
        pool["free"] += len(slots)

    cache = RadixCache(eviction_policy=policy, evict_callback=give_back)
    reused = prompt_tokens = next_slot = 0
    for prompt, answer in trace:
        hit = cache.match_prefix(prompt[:-1])
        cache.lock(hit.last_node)
        tokens = prompt + answer
        new = len(tokens) - len(hit)
        if pool["free"] < new:
            cache.evict(new - pool["free"])
        pool["free"] -= new
        present = cache.insert(tokens, torch.cat([hit.indices, torch.arange(next_slot, next_slot + new)]))
        pool["free"] += present - len(hit)  # our copies of tokens the tree already had
        next_slot += new
        cache.unlock(hit.last_node)
        reused += len(hit)
        prompt_tokens += len(prompt)
    return reused / prompt_tokens


LFU_CHOICES = {
    "a": "LFU evicts the shared system prompt, which LRU keeps",
    "b": "a conversation's newest turn, the part its next turn reuses, has no hits yet, while the early "
         "turns of conversations that have ended keep the hits they collected: LFU evicts what is about "
         "to be reused and keeps what never will be",
    "c": "counting hits costs time, so LFU serves fewer requests",
}


def check_lfu_measured(lru: dict, lfu: dict, why: str) -> bool:
    """Exercise 5: hit rates {num_slots: rate} of LRU and of your LFU key on chat_trace(), for the
    pools the notebook names, and the letter of LFU_CHOICES that explains the difference."""
    if not (isinstance(lru, dict) and isinstance(lfu, dict) and lru and set(lru) == set(lfu)
            and all(type(n) is int and n > 0 for n in lru)):
        return report(False, "give two dicts {num_slots: hit rate}, one per policy, for the same pool sizes "
                             "(ints): hit_rate(trace, n, 'lru') and hit_rate(trace, n, lfu_key).")
    trace = chat_trace()
    for n in sorted(lru):
        want = (_hit_rate(trace, n, "lru"), _hit_rate(trace, n, "lfu"))
        if not all(isinstance(x, (int, float)) and abs(x - w) < 1e-9 for x, w in zip((lru[n], lfu[n]), want)):
            return report(False, f"at {n} slots LRU reuses {want[0]:.2f} of the prompt tokens and LFU {want[1]:.2f}, "
                                 f"you have {lru[n]!r} and {lfu[n]!r}: measure with hit_rate on ch03.chat_trace(), "
                                 "with an LFU key that passes exercise 4.")
    print(f"{'pool slots':>10} {'LRU':>6} {'LFU':>6}")
    for n in sorted(lru):
        print(f"{n:>10} {lru[n]:>6.2f} {lfu[n]:>6.2f}")
    return report(why == "b", "both policies evict only leaves, and the hit rate counts tokens, not time. Which "
                              "leaves have no hits in a chat, and which keep theirs after their conversation ends?")
