"""The Triton kernels behind chapter 5's attention signature: `triton_paged_attention`.

Every layer of a step: `store_kvcache` writes the new K and V at `md.slot_mapping`; then a decode
step (one new token per sequence, which `md`'s shapes tell without asking the device) runs
`paged_decode_attention`, and any other step `extend_attention` for all its sequences, both reading
each sequence's context through `md.kv_indices`, its `req_to_token` row (one slot per position, so
page_size 1 in the kernels' terms, whatever the pool's page size). A pool of kv_cache_dtype "int8"
(chapter 10) is quantized in the store kernel and dequantized in the extend kernel's tile load,
which then serves its decode steps too (stage 1 of the decode kernel, chapter 5's exercise, reads
float caches); the other quantized formats are refused (serve them with attention_backend="torch").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlearn.attention import AttentionMetadata
from kvlearn.kernels.decode import paged_decode_attention
from kvlearn.kernels.extend import extend_attention
from kvlearn.kernels.store import store_kvcache

KV_CACHE_DTYPES = ("auto", "int8")   # the pools the kernels read


def triton_paged_attention(query, key, value, layer: int, kv_pool, md: AttentionMetadata, scale=None, *,
                           stage1=None) -> torch.Tensor:
    """Chapter 5's `paged_attention` with Triton kernels: the same arguments, the same result.
    query: [T, heads, head_dim] (RoPE applied); key, value: [T, kv_heads, head_dim]. stage1: the
    decode steps' stage-1 kernel (`paged_decode_attention`'s argument; None: the package's)."""
    if kv_pool.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"The Triton kernels read a pool of kv_cache_dtype {' or '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"this one is {kv_pool.kv_cache_dtype!r}: serve it with attention_backend='torch'.")
    k_cache, v_cache, k_scale, v_scale = kv_pool.k[layer], kv_pool.v[layer], None, None
    if kv_pool.kv_cache_dtype == "int8":   # int8 codes, each row's float32 scale after them (kvlearn.quant)
        (k_cache, k_scale), (v_cache, v_scale) = kv_pool.format.unpack(k_cache), kv_pool.format.unpack(v_cache)
    store_kvcache(key, value, k_cache, v_cache, md.slot_mapping, k_scale, v_scale)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    max_q_len = md.query_index.shape[1]
    if max_q_len == 1 and k_scale is None:
        return paged_decode_attention(query, k_cache, v_cache, md.kv_indices, md.kv_lens, scale, stage1=stage1)
    cu_q = F.pad(md.last_token + 1, (1, 0))
    return extend_attention(query, k_cache, v_cache, md.kv_indices, md.kv_lens, cu_q, scale, max_q_len=max_q_len,
                            k_scale=k_scale, v_scale=v_scale)
