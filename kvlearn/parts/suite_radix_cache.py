"""The conformance suite of the `radix_cache` part (chapter 3), judged by `RadixReference`.

A program is a page size and random operations over a 3-token alphabet (so keys share prefixes and
split edges all the time): insert (often extending an earlier key), insert_prefix and lock its
node (as the engine does), match, match and lock, unlock, evict, `unlocked_on_path`, bad input
(a negative token id, a value of the wrong length, unlocking a node nobody locked), and now and
then a key of more than 256 tokens. After every call the three sizes and the tree's shape (where
its nodes end) must be the reference's; every eviction callback must hand back one whole,
unlocked, least recently used leaf.
"""

from __future__ import annotations

import random

import torch

from kvlearn.parts.judge import Broken, Trace, ints, number, same
from kvlearn.parts.radix_cache import RadixCachePart
from kvlearn.parts.references import RadixReference
from kvlearn.radix_base import RadixCacheBase

CONTRACT = RadixCachePart

HINTS = {
    "match": "match_prefix walks down from the root: at each node, the child keyed by the next token (page); "
             "it follows the whole edge when the key goes on with it, and when the key stops inside an edge "
             "it splits that edge there, so last_node ends exactly at the matched length (chapter 3). Only "
             "whole pages match.",
    "match_len": "match_len tells how many tokens match_prefix would match, without splitting or touching anything.",
    "insert": "insert(key, value) walks like match_prefix, then hangs one new leaf with the rest of the key "
              "(whole pages) and its slots; it returns how many leading tokens were already cached, and "
              "keeps the slots the tree already had for them.",
    "insert_prefix": "insert_prefix returns insert's answer and the match of the whole inserted (page-aligned) "
                     "key: the tree's slots for every token.",
    "lock": "lock(node) adds one to lock_ref of the node and every ancestor up to the root; a node whose "
            "lock_ref goes 0 -> 1 moves its tokens from evictable_size to protected_size, and unlock undoes it. "
            "A split keeps the lower part as the same node object, so a lock held on it stays right.",
    "unlocked_on_path": "unlocked_on_path(node) counts the tokens from node up to the root in nodes whose "
                        "lock_ref is 0.",
    "split_lock": "a split must give the new upper node the lock_ref of the node it was cut from: every lock "
                  "below that node passes through it (unlocked_on_path is the base's and only reads lock_ref, "
                  "so one of your nodes has a wrong lock_ref).",
    "evict": "evict(n) frees whole unlocked leaves, least recently used first (a match or insert that walks "
             "through a node makes it recent), handing each leaf's value to evict_callback; a parent left as "
             "an unlocked leaf goes in line too. It stops as soon as n tokens are freed, or when nothing "
             "evictable is left, and returns the tokens freed.",
    "slots": "the tree holds each cached token's slot once: insert stores only the slots of the tokens that "
             "were not cached yet (the caller frees the others), and an evicted node leaves the tree, its slots "
             "handed to evict_callback.",
    "sizes": "evictable_size + protected_size == total_size: tokens in unlocked nodes, in locked nodes, in all "
             "nodes (chapter 3).",
    "shape": "a node ends where an insert ended or where a match stopped inside an edge, nowhere else: "
             "match_prefix follows a whole edge as long as the key goes on with it (compare page after page to "
             "the edge's end) and splits an edge only where the key stops inside it; insert hangs one new leaf "
             "holding the whole rest of the key (chapter 3).",
    "bad": "bad input (a negative token id, a value whose length is not the key's) raises ValueError or "
           "TypeError before anything changes (RadixCacheBase.as_key and as_value check keys and values).",
    "bad_unlock": "unlock(node) of a node that was not locked itself raises ValueError and changes nothing: "
                  "count the locks taken on exactly this node (TreeNode.own_locks), so unlock can tell; "
                  "lock_ref also counts the locks of the nodes below.",
}


# A "long" operation inserts a key of more than 256 tokens, matches it and inserts it again: lengths
# that big catch `is` between ints (CPython shares the objects of small ints only, so `k is not
# len(edge)` agrees with `!=` below 257).
LONG = 270


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"page_size": rng.choice([1, 1, 2])}
    kinds = ["insert", "insert", "insert_prefix_lock", "match", "match_lock", "unlock", "unlock", "evict",
             "unlocked_on_path", "bad_key", "bad_value", "bad_unlock"]
    ops = [(rng.choice(kinds), rng.randrange(1 << 30)) for _ in range(rng.randint(1, 30))]
    if rng.random() < 0.1:   # now and then a key of more than 256 tokens (see LONG)
        ops.insert(rng.randint(0, len(ops)), ("long", rng.randrange(1 << 30)))
    return setup, ops


def _key(rng: random.Random, keys: list[tuple]) -> tuple:
    tail = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 8)))
    if keys and rng.random() < 0.7:
        base = rng.choice(keys)
        return base[:rng.randint(0, len(base))] + tail
    return tail


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    page = setup["page_size"]
    ref, evicted = RadixReference(page), []

    def on_evict(value):
        evicted.append(value)

    trace.note("freed = []   # evict_callback: the slots of each evicted node")
    cache = trace.call(f"cache = {impl.__name__}(page_size={page}, evict_callback=freed.append, device='cpu')",
                       impl, page_size=page, evict_callback=on_evict, device="cpu")
    keys, locks, next_slot, names = [], [], [0], iter(range(1, 1 << 30))

    def fresh(n):
        value = torch.arange(next_slot[0], next_slot[0] + n)
        next_slot[0] += n
        return value

    def match(key, name):
        expect_len, expect_slots = ref.match(key)
        result = a_match("match_prefix", trace.call(f"{name} = cache.match_prefix({list(key)})",
                                                    cache.match_prefix, list(key)))
        got = ints(f"{name}.indices", trace.call(f"{name}.indices", lambda: result.indices, quiet=True))
        length = number(f"len({name})", trace.call(f"len({name})", len, result, quiet=True))
        trace.answer(f"len {length}, indices {got}")
        same(f"len(cache.match_prefix({list(key)}))", expect_len, length, HINTS["match"])
        same(f"cache.match_prefix({list(key)}).indices", expect_slots, got, HINTS["match"])
        return trace.call(f"{name}.last_node", lambda: result.last_node, quiet=True), key[:expect_len]

    def insert(key):
        value = fresh(len(key))
        got = number("insert's answer", trace.call(
            f"cache.insert({list(key)}, torch.tensor({value.tolist()}))", cache.insert, list(key), value))
        trace.answer(str(got))
        same(f"cache.insert({list(key)}, ...)", ref.insert(key, value.tolist())[0], got, HINTS["insert"])

    for trace.op, (op, r) in enumerate(ops):
        rng = random.Random(r)
        if op == "long":   # not among `keys`: later keys stay short
            key = (rng.choice(keys) if keys else ()) + tuple(rng.randint(0, 2) for _ in range(LONG))
            insert(key)
            match(key, f"m{next(names)}")
            insert(key)
        elif op in ("insert", "insert_prefix_lock"):
            key = _key(rng, keys)
            keys.append(key)
            if op == "insert":
                insert(key)
            else:
                value = fresh(len(key))
                name = f"m{next(names)}"
                got = trace.call(f"n, {name} = cache.insert_prefix({list(key)}, torch.tensor({value.tolist()}))",
                                 cache.insert_prefix, list(key), value)
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise Broken(f"insert_prefix must return (int, match), got {got!r}", HINTS["insert_prefix"])
                a_match("insert_prefix's match", got[1])
                present, slots = ref.insert(key, value.tolist())
                same("insert_prefix's length", present, number("insert_prefix's length", got[0]), HINTS["insert"])
                same(f"{name}.indices", slots, ints(f"{name}.indices", got[1].indices), HINTS["insert_prefix"])
                node = got[1].last_node
                trace.call(f"cache.lock({name}.last_node)", cache.lock, node)
                ref.lock(ref.aligned(key))
                locks.append((node, ref.aligned(key), name))
        elif op in ("match", "match_lock", "unlocked_on_path", "bad_unlock"):
            key = _key(rng, keys)
            expect = ref.cached_length(key)
            got = number("match_len's answer", trace.call(f"cache.match_len({list(key)})", cache.match_len, list(key)))
            trace.answer(str(got))
            same(f"cache.match_len({list(key)})", expect, got, HINTS["match_len"])
            check_sizes(cache, ref, trace)   # match_len changed nothing
            name = f"m{next(names)}"
            node, prefix = match(key, name)
            if op == "match_lock":
                trace.call(f"cache.lock({name}.last_node)", cache.lock, node)
                ref.lock(prefix)
                locks.append((node, prefix, name))
            elif op == "unlocked_on_path":
                got = number("unlocked_on_path's answer",
                             trace.call(f"cache.unlocked_on_path({name}.last_node)", cache.unlocked_on_path, node))
                trace.answer(str(got))
                expect = page * sum(not ref.locked(prefix[:j]) for j in range(page, len(prefix) + 1, page))
                own = getattr(type(cache), "unlocked_on_path", None) is not RadixCacheBase.unlocked_on_path
                same(f"cache.unlocked_on_path({name}.last_node)", expect, got,
                     HINTS["unlocked_on_path" if own else "split_lock"])
            elif op == "bad_unlock" and prefix not in ref.locks:
                trace.refused(f"cache.unlock({name}.last_node)   # nobody locked it", (ValueError,), cache.unlock,
                              node, hint=HINTS["bad_unlock"])
        elif op == "unlock" and locks:
            node, prefix, name = locks.pop(rng.randrange(len(locks)))
            trace.call(f"cache.unlock({name}.last_node)", cache.unlock, node)
            ref.unlock(prefix)
        elif op == "evict":
            n = rng.randint(0, 12)
            evicted.clear()
            got = number("evict's answer", trace.call(f"cache.evict({n})", cache.evict, n))
            trace.answer(f"{got}, freed {[v.tolist() if isinstance(v, torch.Tensor) else v for v in evicted]}")
            sizes = []
            for value in evicted:
                slots = ints("the value given to evict_callback", value)
                problem = ref.evicted(slots)
                if problem:
                    raise Broken(f"cache.evict({n}): {problem}", HINTS["evict"])
                sizes.append(len(slots))
            same(f"cache.evict({n})'s answer (tokens handed to evict_callback)", sum(sizes), got, HINTS["evict"])
            if got < n and ref.evictable_size:
                raise Broken(f"cache.evict({n}) freed {got} tokens and stopped with {ref.evictable_size} "
                             "evictable tokens left", HINTS["evict"])
            if sizes and got - sizes[-1] >= n:
                raise Broken(f"cache.evict({n}) went on evicting after {got - sizes[-1]} tokens were freed",
                             HINTS["evict"])
        elif op == "bad_key":
            key = list(_key(rng, keys)) + [-1]
            trace.refused(f"cache.insert({key}, torch.tensor({list(range(len(key)))}))", (ValueError, TypeError),
                          cache.insert, key, torch.arange(len(key)), hint=HINTS["bad"])
        elif op == "bad_value":
            key = list(_key(rng, keys)) + [0]
            trace.refused(f"cache.insert({key}, torch.tensor({list(range(len(key) + 1))}))",
                          (ValueError, TypeError), cache.insert, key, torch.arange(len(key) + 1), hint=HINTS["bad"])
        else:
            continue
        check_sizes(cache, ref, trace)


def a_match(what: str, got):
    """`got` if it looks like a MatchResult (`.indices`, `.last_node`, `len()`); `Broken` otherwise."""
    if not all(hasattr(type(got), member) or hasattr(got, member) for member in ("indices", "last_node", "__len__")):
        raise Broken(f"{what} must return a MatchResult (.indices, .last_node, len()), got {type(got).__name__}",
                     "return kvlearn.radix.MatchResult(indices, last_node): the slot ids of the matched tokens "
                     "(a 1-D int64 tensor) and the node where the match ends.")
    return got


def check_sizes(cache, ref: RadixReference, trace: Trace) -> None:
    """The three sizes; slot conservation: the tree's nodes hold exactly the reference's slots
    (every other slot given to insert went back through evict_callback or to the caller); and the
    tree's shape: its nodes end exactly at the reference's `ends`."""
    for size in ("total_size", "protected_size", "evictable_size"):
        got = number(size, trace.call(f"cache.{size}", getattr, cache, size, quiet=True))
        same(f"cache.{size}", getattr(ref, size), got, HINTS["sizes" if size == "total_size" else "lock"])
    nodes = trace.call("cache.nodes()", cache.nodes, quiet=True)
    held = sorted(s for node in nodes for s in ints("a node's value", node.value))
    same("the slots the tree's nodes hold (sorted)", sorted(s for page in ref.slot.values() for s in page), held,
         HINTS["slots"])
    ends = node_ends(nodes)
    for end in sorted(set(ends) | ref.ends, key=lambda e: (len(e), e)):
        count = ends.count(end)
        if count != (end in ref.ends):
            where = "where an insert ended or a match stopped" if end in ref.ends else \
                "where no insert ended and no match stopped"
            has = {0: "no node", 1: "a node"}.get(count, f"{count} nodes")
            raise Broken(f"the tree has {has} ending after tokens {list(end)}, {where} "
                         f"(its nodes end after {sorted(map(list, ends), key=len)})", HINTS["shape"])


def node_ends(nodes: list) -> list[tuple]:
    """The tokens from the root to the end of each node but the root (a walk up its parents)."""
    ends = []
    for node in nodes:
        prefix, up = (), node
        for _ in range(len(nodes)):   # a parent chain longer than the tree is a loop
            if up is None:
                break
            prefix, up = tuple(up.key) + prefix, up.parent
        if node.parent is not None:
            ends.append(prefix)
    return ends
