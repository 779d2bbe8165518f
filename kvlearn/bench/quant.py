"""Chapter 10's measurement: what a quantized pool costs one decode step on this machine, outside
the model. A step writes each new token's K and V into the pool (encoded in the pool's format) and,
in every layer, reads each sequence's whole context back (gathered, and decoded to the model's
dtype), as chapter 5's torch attention does. Timings depend on the machine and its load.
"""

from __future__ import annotations

import time

import torch

from kvlearn.pool import KVPool


def pool_step_ms(config, kv_cache_dtype: str, context_tokens: int = 4096, new_tokens: int = 8,
                 repeats: int = 10) -> dict[str, float]:
    """Milliseconds one decode step of `new_tokens` sequences spends in the pool, every layer, best of
    `repeats`: "write" (encode and store each new token's K and V) and "read" (gather and decode the
    K and V of `context_tokens` tokens in all)."""
    pool = KVPool.for_model(config, num_slots=context_tokens, kv_cache_dtype=kv_cache_dtype)
    torch.manual_seed(0)
    k = torch.randn(context_tokens, pool.num_kv_heads, pool.head_dim)
    context = pool.alloc(context_tokens)
    for layer in range(pool.num_layers):
        pool.write(layer, context, k, k)
    new, step = context[:new_tokens], k[:new_tokens]
    best = {"write": float("inf"), "read": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(pool.num_layers):
            pool.write(layer, new, step, step)
        middle = time.perf_counter()
        for layer in range(pool.num_layers):
            for cache in (pool.k[layer], pool.v[layer]):
                pool.format.decode(cache.index_select(0, context), torch.float32)
        end = time.perf_counter()
        best = {"write": min(best["write"], middle - start), "read": min(best["read"], end - middle)}
    return {name: round(1e3 * s, 3) for name, s in best.items()}
