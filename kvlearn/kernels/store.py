"""`store_kvcache`: write one layer's new K and V into the pool at `slot_mapping`, as a Triton kernel.

Chapter 5's torch version is one scatter, `kv_pool.write(layer, md.slot_mapping, key, value)`.
nano-vllm does the same job with a Triton kernel of the same name, one program per token. Here one
program copies `BLOCK_T` tokens: a tile of `[BLOCK_T, kv_heads * head_dim]` numbers, each token's
row read from the step's K (or V) and written to the row of its slot in the cache.

Which program does what: program `i` copies tokens `i * BLOCK_T .. i * BLOCK_T + BLOCK_T - 1` (the
last one masks off what lies past the step's end), K and V alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlearn.kernels.common import check_launch, check_rows, check_same_device

BLOCK_T = 16   # tokens per program


@triton.jit
def store_kernel(key, value, k_cache, v_cache, slot_mapping, num_tokens,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                 HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)        # [BLOCK_T] the tokens of this program
    hd = tl.arange(0, ROW_P2)                                     # [ROW_P2] (kv head, dim) of a row, flattened
    head, dim = hd // HEAD_DIM, hd % HEAD_DIM
    ok = (t < num_tokens)[:, None] & (hd < ROW)[None, :]
    slot = tl.load(slot_mapping + t, mask=t < num_tokens, other=0)  # [BLOCK_T] where each token's K/V go
    dst = slot[:, None] * stride_cs + head[None, :] * stride_ch + dim[None, :]
    k = tl.load(key + t[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=ok)
    v = tl.load(value + t[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=ok)
    tl.store(k_cache + dst, k, mask=ok)
    tl.store(v_cache + dst, v, mask=ok)



def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = key and v_cache[slot_mapping] = value. key, value: [T, kv_heads,
    head_dim] (any strides, head_dim contiguous); caches: one layer's [slots, kv_heads, head_dim],
    K and V with the same strides (a `KVPool`'s `k[layer]` and `v[layer]`); slot_mapping: [T] int64."""
    check_launch(key.device)
    check_rows(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = kv_heads * head_dim
    store_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=head_dim, ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_T=BLOCK_T)
