"""`extend_attention`: a prefill, or a chunk of new tokens after a cached prefix, as a Triton kernel.

Each sequence of the step brings `q_len` new tokens whose K and V are already in the cache
(`store_kvcache` ran first), after `kv_len - q_len` cached ones. New token i sits at position
`kv_len - q_len + i` and sees every position up to its own: all of the cached prefix, and the new
tokens causally. Chapter 5's torch version builds that as a boolean mask over a padded gather;
here the mask is two comparisons inside the kernel, and nothing is gathered.

Which program computes what (`extend_kernel`, grid `[B, heads, ceil(max q_len / BLOCK_M)]`):
program (b, h, j) takes new tokens `j * BLOCK_M ..` of sequence b for query head h, walks the
context a tile of `BLOCK_N` positions at a time through the table (as `paged_decode_attention`
does) with a running max and sum, and stops after the last position its tokens can see.

SGLang's `extend_attention` reads the cached prefix from the pool and the new tokens' K and V from
the step's own buffers, in two loops; here both come from the pool, in one loop with one mask.
A decode is an extend with q_len 1, so a step that mixes prefills and decodes runs this kernel
for all of them. Tiles and products as in `paged_decode_attention`: head_dim padded to
`tile(head_dim)` with a mask, products in the cache's dtype with float32 accumulation.

An int8 pool (chapter 10; `QUANTIZED`) is dequantized in the tile load: each K and V row's int8
codes times its scale, in float32, then in the query's dtype, as chapter 5's torch path decodes the
gathered rows; nothing dequantized is ever written. The Triton backend serves an int8 pool's decode
steps with this kernel too (a decode is an extend with q_len 1): `paged_decode_attention`'s stage 1,
chapter 5's exercise, reads float caches only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlearn.kernels.common import check_extend, dot_dtype, tile

BLOCK_M = 32   # new tokens per program
BLOCK_N = 64   # context positions per tile
# 4 warps: one 16 x 32 piece of a [32, 64] score tile each; 2 stages: the next tile's K and V load
# while this one's softmax runs.
LAUNCH = dict(num_warps=4, num_stages=2)


# The table's row stride (its width) changes from step to step: not specialized, as in decode_kernel.
@triton.jit(do_not_specialize=["stride_tb"])
def extend_kernel(query, k_cache, v_cache, k_scale, v_scale, table, kv_lens, cu_q, out, scale,
                  stride_qt, stride_qh, stride_cs, stride_ch, stride_ss, stride_sh, stride_tb, stride_ot, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  QUANTIZED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // GROUP                                                 # the KV head query head h reads
    q_start = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_start
    kv_len = tl.load(kv_lens + b)
    i = j * BLOCK_M + tl.arange(0, BLOCK_M)                        # [BLOCK_M] new tokens of this program
    i_ok = i < q_len
    q_pos = kv_len - q_len + i                                     # their positions in the sequence
    d = tl.arange(0, BLOCK_D)                                      # head_dim, padded to a power of two
    d_ok = d < HEAD_DIM
    q = tl.load(query + (q_start + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)      # [BLOCK_M, BLOCK_D]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # No token of this program sees past the last one's position; a program past q_len does nothing.
    end = tl.where(j * BLOCK_M < q_len, tl.minimum(kv_len, kv_len - q_len + (j + 1) * BLOCK_M), 0)
    for n in range(0, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        ok = pos < end
        # int64, as in paged_decode_attention: slot * stride passes 2**31 in a large pool.
        page = tl.load(table + b * stride_tb + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        at = slot[:, None] * stride_cs + g * stride_ch + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + at, mask=kv_ok, other=0.0)
        v = tl.load(v_cache + at, mask=kv_ok, other=0.0)
        if QUANTIZED:   # codes times their row's scale, in float32
            row = slot * stride_ss + g * stride_sh
            k = k.to(tl.float32) * tl.load(k_scale + row, mask=ok, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(v_scale + row, mask=ok, other=0.0)[:, None]
        k, v = k.to(DOT_DTYPE), v.to(DOT_DTYPE)
        score = tl.dot(q, tl.trans(k), input_precision="ieee") * scale         # [BLOCK_M, BLOCK_N]
        # Causal: position pos is seen by the tokens at or after it. Position 0 is in the first
        # tile and seen by every token, so no row's max stays -inf after it.
        score = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m = m_new

    # Rows past q_len (l == 0) are not stored; dividing them by 1 keeps the arithmetic clean.
    tl.store(out + (q_start + i)[:, None] * stride_ot + h * stride_oh + d[None, :],
             acc / tl.where(l > 0, l, 1.0)[:, None], mask=i_ok[:, None] & d_ok[None, :])


def extend_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     kv_lens: torch.Tensor, cu_q: torch.Tensor, scale: float, page_size: int = 1,
                     max_q_len: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every sequence's new tokens over its context, read through `table`.

    query [T, heads, head_dim]: the step's new tokens packed sequence after sequence, sequence b's
    being rows cu_q[b] .. cu_q[b+1] - 1 (cu_q [B+1], from 0 to T), their K/V already in the cache;
    caches, table, kv_lens and page_size as in `paged_decode_attention` (kv_lens[b] >= its new
    tokens >= 1); with k_scale and v_scale, the caches are an int8 pool's codes, as in
    `store_kvcache`. max_q_len: the largest new-token count, if the caller knows it without asking
    the device. Returns [T, heads, head_dim]. Refuses what the kernel cannot run, as
    `kvlearn.kernels.common` says."""
    check_extend(query, k_cache, v_cache, table, kv_lens, cu_q, page_size, max_q_len, (k_scale, v_scale))
    tokens, heads, head_dim = query.shape
    batch = kv_lens.shape[0]
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    quantized = k_scale is not None
    if not quantized:   # the kernel reads no scale: any pointer does, with strides 0
        k_scale = v_scale = k_cache
    out = torch.empty(tokens, heads, head_dim, dtype=query.dtype, device=query.device)
    extend_kernel[(batch, heads, triton.cdiv(max_q_len, BLOCK_M))](
        query, k_cache, v_cache, k_scale, v_scale, table, kv_lens, cu_q, out, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0, table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=heads // k_cache.shape[1], HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        DOT_DTYPE=dot_dtype(query.dtype if quantized else k_cache.dtype), QUANTIZED=quantized,
        BLOCK_M=BLOCK_M, BLOCK_D=tile(head_dim), BLOCK_N=BLOCK_N, **LAUNCH)
    return out
