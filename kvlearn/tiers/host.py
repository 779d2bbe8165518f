"""Chapter 8: the host tier, a second KV pool in CPU memory, and copies between pools.

The host pool has the device pool's layout (`[layers, 2, slots, kv_heads, row]`), format
(`kv_cache_dtype`: quantized rows move with their scales, chapter 10) and page size, so a node's KV
moves between them slot for slot. On a CPU-only machine both pools are CPU tensors and a copy is a
memcpy; on a GPU the host pool would be pinned memory and copies would run on their own CUDA stream
(see the chapter's notebook).
"""

from __future__ import annotations

import torch

from kvlearn.errors import check_positive_int
from kvlearn.pool import KVPool


def host_pool_for(pool: KVPool, num_slots: int) -> KVPool:
    """A CPU pool shaped like `pool` with `num_slots` slots (a multiple of its page size)."""
    check_positive_int("host_slots", num_slots, " (tokens of KV the host tier holds)")
    if num_slots % pool.page_size:
        raise ValueError(f"host_slots ({num_slots}) must be a multiple of page_size ({pool.page_size}): "
                         f"use {num_slots // pool.page_size * pool.page_size or pool.page_size}.")
    return KVPool(pool.num_layers, pool.num_kv_heads, pool.head_dim, num_slots, dtype=pool.dtype,
                  device="cpu", page_size=pool.page_size, kv_cache_dtype=pool.kv_cache_dtype)


def copy_kv(src: KVPool, src_slots: torch.Tensor, dst: KVPool, dst_slots: torch.Tensor) -> None:
    """Copy K and V of every layer from `src_slots` of one pool to `dst_slots` of another."""
    kv = src.kv.index_select(2, src_slots.to(src.device))
    dst.kv.index_copy_(2, dst_slots.to(dst.device), kv.to(dst.device))
