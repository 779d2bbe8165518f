"""`store_kvcache`: write one layer's new K and V into the pool at `slot_mapping`, as a Triton kernel.

Chapter 5's torch version is one scatter, `kv_pool.write(layer, md.slot_mapping, key, value)`.
nano-vllm does the same job with a Triton kernel of the same name, one program per token. Here one
program copies `BLOCK_T` tokens: a tile of `[BLOCK_T, kv_heads * head_dim]` numbers, each token's
row read from the step's K (or V) and written to the row of its slot in the cache.

Which program does what: program `i` copies tokens `i * BLOCK_T .. i * BLOCK_T + BLOCK_T - 1` (the
last one masks off what lies past the step's end), K and V alike. A row's `kv_heads * head_dim`
numbers fill a tile of the next power of two, the rest masked, so any head_dim works. A token whose
slot is -1 is padding, as in nano-vllm: written nowhere.

An int8 pool (chapter 10) is quantized here, in the kernel that writes it: `store_int8_kernel`
gives each program the `BLOCK_T` tokens of one KV head, so a row is a tile's line, and writes the
bytes `kvlearn.quant.Int8Format.encode` writes: scale absmax / 127 in float32, codes x / scale
clamped to [-127, 127] and rounded half to even, as torch.round (an all-zero row: scale 0, codes 0).
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


@triton.jit
def round_half_even(x):
    """torch.round's rounding, ties to even, of float32 numbers below 2**22 in size: x + 0.5 is then
    exact, so floor(x + 0.5) is round-half-up, one too large at a tie whose result is odd."""
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & (r % 2 != 0), r - 1, r)


@triton.jit
def quantize_rows(rows, codes, scales, t, g, slot, ok, d, d_ok, stride_t, stride_h, stride_cs, stride_ch,
                  stride_ss, stride_sh):
    """Rows t of KV head g (a [BLOCK_T, BLOCK_D] tile), quantized to int8 codes and a scale at their slots."""
    x = tl.load(rows + t[:, None] * stride_t + g * stride_h + d[None, :], mask=ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)                          # padding dims load 0: no larger absmax
    scale = tl.max(tl.abs(x), 1) / 127.0                           # [BLOCK_T] one per row
    q = x / tl.where(scale > 0, scale, 1.0)[:, None]               # an all-zero row: 0 / 1, codes 0
    q = round_half_even(tl.minimum(tl.maximum(q, -127.0), 127.0))
    tl.store(codes + slot[:, None] * stride_cs + g * stride_ch + d[None, :], q.to(tl.int8),
             mask=ok[:, None] & d_ok[None, :])
    tl.store(scales + slot * stride_ss + g * stride_sh, scale, mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def store_int8_kernel(key, value, k_codes, v_codes, k_scale, v_scale, slot_mapping, num_tokens,
                      stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss, stride_sh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)        # [BLOCK_T] the tokens of this program
    g = tl.program_id(1)                                          # its KV head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot = tl.load(slot_mapping + t, mask=t < num_tokens, other=-1).to(tl.int64)   # -1: written nowhere
    ok = slot >= 0
    quantize_rows(key, k_codes, k_scale, t, g, slot, ok, d, d_ok, stride_kt, stride_kh, stride_cs, stride_ch,
                  stride_ss, stride_sh)
    quantize_rows(value, v_codes, v_scale, t, g, slot, ok, d, d_ok, stride_vt, stride_vh, stride_cs, stride_ch,
                  stride_ss, stride_sh)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """k_cache[slot_mapping] = key and v_cache[slot_mapping] = value, skipping slot -1 (padding).
    key, value: [T, kv_heads, head_dim] (any strides, head_dim contiguous); caches: one layer's
    [slots, kv_heads, head_dim], K and V with the same strides (a `KVPool`'s `k[layer]` and
    `v[layer]`); slot_mapping: [T] int64 or int32, each slot in the pool or -1. With k_scale and
    v_scale ([slots, kv_heads, 1] float32), the caches are an int8 pool's codes and each row is
    quantized into them (the module says how). Refuses what the kernel cannot run, as
    `kvlearn.kernels.common` says."""
    check_store(key, value, k_cache, v_cache, slot_mapping, (k_scale, v_scale))
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_scale is not None:
        store_int8_kernel[(triton.cdiv(num_tokens, BLOCK_T), kv_heads)](
            key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_scale.stride(0), k_scale.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=BLOCK_T, **LAUNCH)
        return
    row = kv_heads * head_dim
    store_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=head_dim, ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_T=BLOCK_T, **LAUNCH)
