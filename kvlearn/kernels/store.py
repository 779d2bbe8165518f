"""`store_kvcache`: write one layer's new K and V into the pool at `slot_mapping`, as a Triton kernel.

Chapter 5's torch version is one scatter, `kv_pool.write(layer, md.slot_mapping, key, value)`.
nano-vllm does the same job with a Triton kernel of the same name, one program per token. Here one
program copies `BLOCK_T` tokens: a tile of `[BLOCK_T, kv_heads * head_dim]` numbers, each token's
row read from the step's K (or V) and written to the row of its slot in the cache.

Which program does what: program `i` copies tokens `i * BLOCK_T .. i * BLOCK_T + BLOCK_T - 1` (the
last one masks off what lies past the step's end), K and V alike. A row's `kv_heads * head_dim`
numbers fill a tile of the next power of two, the rest masked, so any head_dim works. A token whose
slot is -1 is padding, as in nano-vllm: written nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlearn.kernels.common import check_store

BLOCK_T = 16   # tokens per program
# 4 warps: a [16, kv_heads * head_dim] tile is a few thousand numbers, a few dozen per thread of 128;
# 1 stage: no loop to pipeline.
LAUNCH = dict(num_warps=4, num_stages=1)


# num_tokens changes from step to step: not specialized (Triton would compile 1, a decode of one
# sequence, and multiples of 16 apart), so one compiled kernel serves every step.
@triton.jit(do_not_specialize=["num_tokens"])
def store_kernel(key, value, k_cache, v_cache, slot_mapping, num_tokens,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                 HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)        # [BLOCK_T] the tokens of this program
    hd = tl.arange(0, ROW_P2)                                     # [ROW_P2] (kv head, dim) of a row, flattened
    head, dim = hd // HEAD_DIM, hd % HEAD_DIM
    # Where each token's K/V go; in int64, as slot * stride passes 2**31 in a large pool. Slot -1 is a
    # padding token (nano-vllm's rule), and so are the tokens past the step's end: written nowhere.
    slot = tl.load(slot_mapping + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (hd < ROW)[None, :]
    dst = slot[:, None] * stride_cs + head[None, :] * stride_ch + dim[None, :]
    k = tl.load(key + t[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=ok)
    v = tl.load(value + t[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=ok)
    tl.store(k_cache + dst, k, mask=ok)
    tl.store(v_cache + dst, v, mask=ok)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = key and v_cache[slot_mapping] = value, skipping slot -1 (padding).
    key, value: [T, kv_heads, head_dim] (any strides, head_dim contiguous); caches: one layer's
    [slots, kv_heads, head_dim], K and V with the same strides (a `KVPool`'s `k[layer]` and
    `v[layer]`); slot_mapping: [T] int64 or int32, each slot in the pool or -1. Refuses what the
    kernel cannot run, as `kvlearn.kernels.common` says."""
    check_store(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = kv_heads * head_dim
    store_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=head_dim, ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_T=BLOCK_T, **LAUNCH)
