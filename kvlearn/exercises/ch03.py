"""Chapter 3 exercises: the engine's re-lock, a history on which LFU and LRU part ways, and the two
policies measured on multi-turn chat. (The chapter's build exercise, your own RadixCache, is judged
by `kvlearn.parts.check("radix_cache", ...)`.)"""

import random

import torch

from kvlearn.exercises import attempt, given, likely_mistake, report
from kvlearn.radix import RadixCache


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
    shown = (f"on a {cache_type.__name__} holding [1, 2, 3] and [1, 2, 7, 7], {given(key=key, value=value)}, "
             "old_node=the node of [1, 2, 3], locked")
    answer, error = attempt(fn, cache, key, value, old, shown=shown)
    if error or not (isinstance(answer, tuple) and len(answer) == 2):
        return [error or f"{shown}: return a pair (node, duplicates), got {answer!r}"]
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
    """Exercise 1: `fn(cache, key, value, old_node) -> (node, duplicates)` does what an engine does
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


def _first_eviction(history, policy: str) -> tuple[list, str | None]:
    """The slots `evict(1)` hands back on an empty RadixCache(eviction_policy=policy) after
    `history(cache)` ran on it, or the error the history raised."""
    taken = []
    cache = RadixCache(eviction_policy=policy, evict_callback=lambda value: taken.append(value.tolist()))
    _, error = attempt(history, cache, shown=f"on an empty RadixCache(eviction_policy={policy!r})")
    if error:
        return [], error
    taken.clear()   # what the history evicted itself does not count
    cache.evict(1)
    return taken, None


def check_policies_disagree(history) -> bool:
    """Exercise 2: `history(cache)` makes calls (insert, match_prefix, ...) on an empty cache, after
    which `cache.evict(1)` takes a different leaf under eviction_policy "lfu" than under "lru"."""
    lru, error = _first_eviction(history, "lru")
    lfu, error = _first_eviction(history, "lfu") if not error else ([], error)
    if error:
        return report(False, error)
    if not lru:
        return report(False, "after your history evict(1) takes nothing: it needs unlocked leaves to choose "
                             "from (insert at least two keys that part ways).")
    return report(lru != lfu, f"both policies evict the leaf with slots {lru[0]} first. LRU takes the leaf used "
                              "longest ago, LFU the one with the fewest hits (the oldest among equals): which "
                              "leaf must have more hits than the other, and yet be used longer ago?")


def chat_trace(num_conversations: int = 40, open_at_once: int = 4, seed: int = 0, vocab: int = 30_000) -> list:
    """Exercise 3's traffic: multi-turn chats as (prompt, answer) token-id lists, in arrival order.

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


def reference_hit_rate(trace, num_slots: int, policy) -> float:
    """The reference `check_lfu_measured` compares with, the notebook's `hit_rate` (exercise 3): per
    turn, match all but the last prompt token, lock, take slots for the rest and the answer
    (evicting when the pool is short), insert prompt + answer, give back the slots of tokens the
    tree already had, unlock. Returns the share of prompt tokens taken from the cache."""
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
    """Exercise 3: hit rates {num_slots: rate} of eviction policies "lru" and "lfu" on chat_trace(),
    for the pools the notebook names, and the letter of LFU_CHOICES that explains the difference."""
    if not (isinstance(lru, dict) and isinstance(lfu, dict) and lru and set(lru) == set(lfu)
            and all(type(n) is int and n > 0 for n in lru)):
        return report(False, "give two dicts {num_slots: hit rate}, one per policy, for the same pool sizes "
                             "(ints): hit_rate(trace, n, 'lru') and hit_rate(trace, n, 'lfu').")
    trace = chat_trace()
    for n in sorted(lru):
        want = (reference_hit_rate(trace, n, "lru"), reference_hit_rate(trace, n, "lfu"))
        if not all(isinstance(x, (int, float)) and abs(x - w) < 1e-9
                   for x, w in zip((lru[n], lfu[n]), want, strict=True)):
            return report(False, f"at {n} slots LRU reuses {want[0]:.2f} of the prompt tokens and LFU {want[1]:.2f}, "
                                 f"you have {lru[n]!r} and {lfu[n]!r}: measure with hit_rate on ch03.chat_trace(), "
                                 "once with 'lru' and once with 'lfu'.")
    print(f"{'pool slots':>10} {'LRU':>6} {'LFU':>6}")
    for n in sorted(lru):
        print(f"{n:>10} {lru[n]:>6.2f} {lfu[n]:>6.2f}")
    return report(why == "b", likely_mistake(why, [
        ("a", "every turn of every conversation hits the shared system prompt: it has the most hits of all, so LFU "
              "keeps it as surely as LRU does."),
        ("c", "the hit rate counts tokens taken from the cache, not time: what counting costs does not enter it.")]) or
        "both policies evict only leaves, and the hit rate counts tokens, not time. Which "
        "leaves have no hits in a chat, and which keep theirs after their conversation ends?")
