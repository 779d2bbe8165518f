"""Routing policies: which replica serves the next request.

A policy sees the request and a `RouterView` of the fleet: per replica, the requests in flight
and the outstanding tokens (prompt and output tokens not yet computed) the router sent there, and,
for `exact` only, a question to the replica's real KV manager. `choose(req, view)` returns a replica
index; `routed(req, replica)` tells the policy where the request went.

- round_robin, random: ignore everything;
- least_load: power of two choices (Mitzenmacher 2001): two random replicas, the one with fewer
  outstanding tokens;
- prefix_hash: consistent hashing of the prompt's first `prefix_tokens` tokens onto a ring of
  virtual nodes, so the same prefix lands on the same replica, unless that replica has more than
  `load_factor` times the average requests in flight: then the least loaded (SGLang's bound);
- cache_aware: SGLang's router. An approximate tree of prefixes per replica, kept from the
  router's own decisions and bounded by LRU. If the fleet is imbalanced (busiest - idlest >
  balance_abs_threshold and busiest > balance_rel_threshold * idlest, in requests), the least
  loaded replica; else, if the best match covers more than cache_threshold of the prompt, the
  replica with the best match (ties: least loaded); else the least loaded;
- exact: the same rule with what each replica really holds (what a router fed with KV events, like
  NVIDIA Dynamo's, knows: the replica's cache, plus the requests it was sent and has not started)
  instead of the approximate trees.
"""

from __future__ import annotations

import bisect
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvlearn.errors import check_positive_int


@dataclass
class RouterView:
    """What the router knows about the fleet. Invariant: the lists have one entry per replica."""

    inflight: list[int]                  # requests sent and not finished
    outstanding: list[int]               # prompt + output tokens of those not yet computed
    # (replica, prompt) -> tokens of the prompt the replica holds, or will once its queue is served
    cached_len: Callable[[int, list[int]], int] | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.inflight)

    def least_loaded(self, among=None) -> int:
        """The replica (of `among`, default all) with the fewest requests in flight, then fewest
        outstanding tokens, then the lowest index."""
        among = range(self.num_replicas) if among is None else among
        return min(among, key=lambda i: (self.inflight[i], self.outstanding[i], i))


class Policy:
    """Base class: `choose` a replica for each request; `routed` is told where it went."""

    name = "policy"

    def choose(self, req, view: RouterView) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define choose(req, view): the replica for req.")

    def routed(self, req, replica: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self.next = 0

    def choose(self, req, view):
        replica = self.next % view.num_replicas
        self.next += 1
        return replica


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, req, view):
        return self.rng.randrange(view.num_replicas)


class LeastLoad(Policy):
    """Power of two choices on outstanding tokens: nearly as balanced as asking every replica,
    without herding every request onto the one that looked idlest a moment ago."""

    name = "least_load"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, req, view):
        if view.num_replicas == 1:
            return 0
        a, b = self.rng.sample(range(view.num_replicas), 2)
        return a if (view.outstanding[a], a) <= (view.outstanding[b], b) else b


class PrefixHash(Policy):
    """Consistent hashing: each replica owns `virtual_nodes` points of a ring; a prompt goes to the
    owner of the first point at or after the hash of its first `prefix_tokens` tokens. Adding or
    removing a replica moves only the prefixes next to its points.

    Bounded load, as SGLang's `prefix_hash.rs`: a replica is overloaded when its requests in flight
    exceed `load_factor` x (all requests in flight + 1) / replicas (the +1 counts the request being
    routed). An overloaded owner loses the request to the least loaded replica that is not
    overloaded (ties: fewer outstanding tokens, then the lowest index); if every replica is
    overloaded, the owner keeps it. load_factor None or inf: unbounded, the owner always keeps it.
    `decisions` counts requests kept by their owner ("ring") and moved by the bound ("load_bound").
    """

    name = "prefix_hash"

    def __init__(self, num_replicas: int, prefix_tokens: int = 256, virtual_nodes: int = 64,
                 load_factor: float | None = 1.25):
        load_factor = math.inf if load_factor is None else load_factor
        if not load_factor > 0:   # also refuses nan
            raise ValueError(f"load_factor must be > 0 (None or inf: unbounded), got {load_factor}.")
        # hashes of tuples of ints do not depend on PYTHONHASHSEED: the ring is the same every run
        points = sorted((hash((replica, v, 0x9E3779B9)), replica)
                        for replica in range(num_replicas) for v in range(virtual_nodes))
        self.ring_keys = [key for key, _ in points]
        self.ring_owners = [owner for _, owner in points]
        self.prefix_tokens = prefix_tokens
        self.load_factor = load_factor
        self.decisions = {"ring": 0, "load_bound": 0}

    def choose(self, req, view):
        key = hash(tuple(req.prompt_ids[:self.prefix_tokens]))
        owner = self.ring_owners[bisect.bisect_left(self.ring_keys, key) % len(self.ring_keys)]
        bound = self.load_factor * (sum(view.inflight) + 1) / view.num_replicas
        within = [i for i in range(view.num_replicas) if view.inflight[i] <= bound]
        if owner in within or not within:
            self.decisions["ring"] += 1
            return owner
        self.decisions["load_bound"] += 1
        return view.least_loaded(within)


def router_page_hashes(token_ids: list[int], page_size: int, h: int = 0) -> list[int]:
    """The router's names for the prompt's full pages: chained hashes, hash i standing for the
    whole prefix up to page i (chapter 2's block hashes), so equal hashes mean equal prefixes.
    Python's `hash` of int tuples: fast and the same in every process (ints are not salted), for
    a router's in-memory guess; keys that outlive the process (chapter 8's disk tier,
    `DiskStore.entry_keys`) use chapter 2's xxh64. `h`: the hash of the pages before `token_ids`,
    to continue a chain."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hash((h, *token_ids[start:start + page_size]))
        hashes.append(h)
    return hashes


class ApproxTree:
    """The router's guess of one replica's cache: the pages (by chained hash) it sent there, at most
    `max_pages`, least recently used evicted first.

    It is a radix tree of pages stored flat: a page's hash names the node and, through the chain,
    its whole path. Invariant: a node is never less recently used than any node below it (paths are
    touched from the leaf up), so LRU eviction always takes a leaf and the tree stays prefix-closed.
    """

    def __init__(self, max_pages: int):
        self.pages: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.max_pages = max_pages
        self.evicted_pages = 0

    def match(self, hashes: list[int]) -> int:
        """Leading pages of `hashes` present in the tree. The tree is prefix-closed, so the pages
        present are exactly a head of the chain: binary search finds its end in a few lookups."""
        pages = self.pages
        if not hashes or hashes[0] not in pages:
            return 0
        lo, hi = 1, len(hashes)          # hashes[lo - 1] is present; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, hashes: list[int]) -> list[int]:
        """Add (or touch) the chain's pages; returns the pages evicted to stay within `max_pages`."""
        pages = self.pages
        for h in reversed(hashes):                 # leaf first: ancestors end up most recent
            pages[h] = None
            pages.move_to_end(h)
        evicted = []
        while len(pages) > self.max_pages:
            evicted.append(pages.popitem(last=False)[0])
        self.evicted_pages += len(evicted)
        return evicted

    @property
    def nbytes(self) -> int:
        """Memory held: the ordered dict plus its int keys."""
        return sys.getsizeof(self.pages) + sum(sys.getsizeof(h) for h in self.pages)

    def __len__(self) -> int:
        return len(self.pages)


class AffinityRule(Policy):
    """SGLang's cache-aware rule (see the module docstring); subclasses say what each replica holds.

    cache_threshold: smallest matched share of the prompt worth following (SGLang: 0.3).
    balance_abs_threshold, balance_rel_threshold: the fleet counts as imbalanced when the busiest
    replica has more than `abs` requests in flight above the idlest AND more than `rel` times as
    many (SGLang: 64 and 1.5, sized for large GPU batches; kvlearn's replicas run far fewer
    requests at once, hence 8).
    """

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: float = 8,
                 balance_rel_threshold: float = 1.5):
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}.")
        for name, value, low in (("balance_abs_threshold", balance_abs_threshold, 0),
                                 ("balance_rel_threshold", balance_rel_threshold, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= {low}, got {value!r} (a large one: the fleet "
                                 "never counts as imbalanced).")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.decisions = {"imbalanced": 0, "cache_hit": 0, "low_match": 0}

    def matched_tokens(self, req, view: RouterView) -> list[int]:
        """Tokens of the prompt each replica holds (or is believed to)."""
        raise NotImplementedError(f"{type(self).__name__} must define matched_tokens(req, view): one count a replica.")

    def imbalanced(self, view: RouterView) -> bool:
        busiest, idlest = max(view.inflight), min(view.inflight)
        return busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest

    def choose(self, req, view):
        if self.imbalanced(view):
            self.decisions["imbalanced"] += 1
            return view.least_loaded()
        matched = self.matched_tokens(req, view)
        best = max(matched)
        if best > self.cache_threshold * req.num_prompt_tokens:
            self.decisions["cache_hit"] += 1
            return view.least_loaded(i for i, m in enumerate(matched) if m == best)
        self.decisions["low_match"] += 1
        return view.least_loaded()


class CacheAware(AffinityRule):
    """The rule on approximate per-replica trees of `tree_page_size`-token pages, kept from the
    router's own decisions; each tree holds at most `max_tree_pages` pages (LRU), as SGLang bounds its tree."""

    name = "cache_aware"

    def __init__(self, num_replicas: int, tree_page_size: int = 16, max_tree_pages: int = 1 << 14, **thresholds):
        super().__init__(**thresholds)
        check_positive_int("tree_page_size", tree_page_size)
        check_positive_int("max_tree_pages", max_tree_pages)
        self.page_size = tree_page_size
        self.trees = [ApproxTree(max_tree_pages) for _ in range(num_replicas)]
        # a prompt's first page -> the replicas whose tree holds it: only those can match anything
        self.holders: dict[int, set[int]] = {}
        self._hashes: tuple = (None, [])      # (request, its page hashes): computed once per request
        self._heads: dict[int, tuple] = {}    # id(first part) -> (that part, its chain, tokens past its last page)

    def _page_hashes(self, req) -> list[int]:
        if self._hashes[0] is not req:
            self._hashes = (req, self.prompt_chain(req))
        return self._hashes[1]

    def prompt_chain(self, req) -> list[int]:
        """`router_page_hashes` of the prompt. A generated prompt starts with a part many requests share (a
        tenant's system prompt): its pages are hashed once per router, not once per request."""
        parts, p = getattr(req, "parts", ()), self.page_size
        if len(parts) < 2:
            return router_page_hashes(req.prompt_ids, p)
        head = self._heads.get(id(parts[0]))
        if head is None or head[0] is not parts[0]:
            chain = router_page_hashes(parts[0], p)
            head = self._heads[id(parts[0])] = (parts[0], chain, parts[0][len(chain) * p:])
        rest = list(head[2]) + [t for part in parts[1:] for t in part]
        return head[1] + router_page_hashes(rest, p, head[1][-1] if head[1] else 0)

    @property
    def num_shared_heads(self) -> int:
        """How many shared first parts (a tenant's system prompt) `prompt_chain` has hashed, once each."""
        return len(self._heads)

    def matched_tokens(self, req, view):
        hashes = self._page_hashes(req)
        matched = [0] * len(self.trees)
        for i in self.holders.get(hashes[0], ()) if hashes else ():   # the others match nothing
            matched[i] = self.trees[i].match(hashes) * self.page_size
        return matched

    def routed(self, req, replica):
        # The prompt is now (about to be) cached there, whichever branch of the rule chose it.
        hashes, tree = self._page_hashes(req), self.trees[replica]
        for h in tree.insert(hashes):
            if h in self.holders:
                self.holders[h].discard(replica)
        if hashes and hashes[0] in tree.pages:
            self.holders.setdefault(hashes[0], set()).add(replica)

    def tree_stats(self) -> dict:
        """Pages and bytes the router's trees hold, and pages their LRU bound evicted."""
        return {"tree_pages": sum(map(len, self.trees)), "tree_bytes": sum(t.nbytes for t in self.trees),
                "tree_evicted_pages": sum(t.evicted_pages for t in self.trees)}


class Exact(AffinityRule):
    """The rule on what each replica really holds: its KV manager's `cached_len` and its queue, as a
    router fed by KV events knows it (NVIDIA Dynamo's KV router, llm-d's precise prefix-cache scorer)."""

    name = "exact"

    def __init__(self, num_replicas: int, **thresholds):
        super().__init__(**thresholds)

    def matched_tokens(self, req, view):
        prompt = req.prompt_ids
        return [view.cached_len(i, prompt) for i in range(view.num_replicas)]


POLICIES = ("round_robin", "random", "least_load", "prefix_hash", "cache_aware", "exact")


def make_policy(name: str, num_replicas: int, seed: int = 0, **options) -> Policy:
    """A fresh policy by name; `options` go to its constructor (e.g. cache_threshold=0.5)."""
    if name == "round_robin":
        return RoundRobin(**options)
    if name == "random":
        return RandomChoice(seed, **options)
    if name == "least_load":
        return LeastLoad(seed, **options)
    if name == "prefix_hash":
        return PrefixHash(num_replicas, **options)
    if name == "cache_aware":
        return CacheAware(num_replicas, **options)
    if name == "exact":
        return Exact(num_replicas, **options)
    raise ValueError(f"Unknown policy {name!r}: choose one of {', '.join(POLICIES)} (or 'all' on the command line).")
