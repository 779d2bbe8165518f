"""Scale check for the radix tree: `python -m kvlearn.bench.radix [--keys N] [--repeat R]`.

The trace (the one used to time SGLang's RadixCache): 100 shared bases of 80 tokens; each of
10,000 keys is a prefix of one base (20 to 80 tokens) followed by 100 fresh tokens, so the tree
ends near 1,000,000 tokens. Each key is matched, then inserted with new slot ids from a
simulated allocator (a counter), as an engine does for every finished request. Reported:
match+insert throughput in key tokens per second (each key's tokens counted once), the cost of
one match on trees of growing size (it should not grow with the tree), and eviction time.
Wall-clock numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvlearn.radix import RadixCache

VOCAB = 49152


def make_trace(num_keys: int = 10_000, num_bases: int = 100, base_len: int = 80, fresh_len: int = 100,
               seed: int = 0) -> list[list[int]]:
    """Keys of 120-180 tokens: base[:L] (L in 20..80) + `fresh_len` random tokens."""
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(base_len)] for _ in range(num_bases)]
    return [rng.choice(bases)[:rng.randint(20, base_len)] + [rng.randrange(VOCAB) for _ in range(fresh_len)]
            for _ in range(num_keys)]


def fill(cache: RadixCache, keys, values) -> float:
    """Match then insert every key; return the seconds it took."""
    start = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        cache.match_prefix(key)
        cache.insert(key, value)
    return time.perf_counter() - start


def slot_values(keys) -> list[torch.Tensor]:
    """Fresh slot ids per key, made before timing so only the tree is measured."""
    out, nxt = [], 0
    for key in keys:
        out.append(torch.arange(nxt, nxt + len(key), dtype=torch.int64))
        nxt += len(key)
    return out


def run(num_keys: int = 10_000, repeat: int = 3) -> dict:
    keys = make_trace(num_keys)
    values = slot_values(keys)
    tokens = sum(map(len, keys))
    best, cache = float("inf"), None
    for _ in range(repeat):
        cache = RadixCache()
        best = min(best, fill(cache, keys, values))
    result = {"keys": num_keys, "key_tokens": tokens, "tree_tokens": cache.total_size,
              "nodes": cache.num_nodes, "match_insert_s": best, "tokens_per_s": tokens / best}

    # One match of a 180-token key that shares an 80-token base, on trees of growing size.
    probe = keys[0][:80] + [VOCAB - 1] * 100
    for n in (num_keys // 100, num_keys // 10, num_keys):
        small = RadixCache()
        fill(small, keys[:n], values[:n])
        start = time.perf_counter()
        for _ in range(1000):
            small.match_prefix(probe)
        result[f"match_us_tree_{small.total_size}"] = (time.perf_counter() - start) * 1000

    # Evict the whole tree in 1,000 calls of 1,000 tokens, then time one evict(num_tokens) call.
    start = time.perf_counter()
    calls = 0
    while cache.evictable_size:
        cache.evict(1000)
        calls += 1
    result["evict_all_s"] = time.perf_counter() - start
    result["evict_calls"] = calls
    full = RadixCache()
    fill(full, keys, values)
    start = time.perf_counter()
    full.evict(full.total_size)
    result["evict_one_call_s"] = time.perf_counter() - start
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    r = run(args.keys, args.repeat)
    print(f"trace: {r['keys']} keys, {r['key_tokens']} key tokens -> tree of {r['tree_tokens']} tokens, "
          f"{r['nodes']} nodes")
    print(f"match+insert: {r['match_insert_s']:.3f} s (best of {args.repeat}) = "
          f"{r['tokens_per_s'] / 1e6:.2f} M tokens/s "
          f"({r['tokens_per_s'] / 1.3e6:.2f}x the 1.3 M tokens/s measured for SGLang's RadixCache)")
    for name, us in r.items():
        if name.startswith("match_us_tree_"):
            print(f"one 180-token match on a {int(name.rsplit('_', 1)[1]):,}-token tree: {us:.1f} us")
    print(f"evict everything in {r['evict_calls']} calls of 1,000 tokens: {r['evict_all_s']:.3f} s; "
          f"in one call: {r['evict_one_call_s']:.3f} s")


if __name__ == "__main__":
    main()
