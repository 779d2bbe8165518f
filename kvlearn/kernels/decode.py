"""`paged_decode_attention`: one new token per sequence attends over its pages, as Triton kernels.

Chapter 5's torch version (`kvlearn.attention.attend`) gathers each sequence's whole context into a
padded `[B, Lmax]` copy, then runs one SDPA. A GPU kernel never makes that copy: each program walks
its sequence's pages itself, a tile at a time, and keeps a running softmax (the online softmax of
FlashAttention), so nothing of size `Lmax` is ever written. This is the job of SGLang's Triton
`decode_attention` (over `req_to_token` rows) and of vLLM's paged attention (over block tables).

Which program computes what (stage 1, `decode_kernel`, grid `[B, kv_heads, num_splits]`):
- program (b, g, s) serves sequence b's query heads that share KV head g (GQA: they read the same K
  and V, so one program loads each tile once for all of them, as SGLang's grouped kernel does);
- it covers split s of the context: positions `s * ceil(L / num_splits)` onward (L: b's context);
- for each tile of `BLOCK_N` positions it looks up their slots in the table (a block table when
  `page_size > 1`: slot = table[b, pos // page_size] * page_size + pos % page_size; with
  `page_size == 1` the table is a `req_to_token` row, one slot per position), loads their K and V,
  scores them, and folds them into the running max `m`, sum `l` and weighted sum `acc`;
- it writes `acc / l` and `log(l) + m` (the log-sum-exp) of its split.
Stage 2 (`decode_reduce_kernel`, grid `[B, heads]`) merges the splits of each head, each weighted by
exp(its log-sum-exp - the largest): the same softmax as over the whole context at once.

Why split (flash-decoding): a decode step has few programs, B * kv_heads, 48 for 16 sequences of
SmolLM2, while a GPU has more than a hundred multiprocessors; splitting long contexts gives each
its own work. On a CPU in Triton's interpreter a split is only more programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlearn.kernels.common import check_launch, check_rows, check_same_device

BLOCK_N = 64          # context positions per tile
SPLIT_TOKENS = 512    # a context gets one split per this many positions of the step's longest ...
MAX_SPLITS = 8        # ... up to this many


@triton.jit
def decode_kernel(query, k_cache, v_cache, table, kv_lens, part_out, part_lse, scale,
                  stride_qt, stride_qh, stride_cs, stride_ch, stride_tb, stride_pb, stride_ph,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    heads = g * GROUP + rows                                       # the query heads that read KV head g
    head_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(query + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_H, D]
    kv_len = tl.load(kv_lens + b)
    per_split = tl.cdiv(kv_len, NUM_SPLITS)
    start = s * per_split
    end = tl.minimum(start + per_split, kv_len)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)             # running max of the scores
    l = tl.zeros([BLOCK_H], tl.float32)                            # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)                # running sum of exp(score - m) * V
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)                            # [BLOCK_N] positions of this tile
        ok = pos < end
        page = tl.load(table + b * stride_tb + pos // PAGE_SIZE, mask=ok, other=0)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        at = slot[:, None] * stride_cs + g * stride_ch + d[None, :]
        k = tl.load(k_cache + at, mask=ok[:, None], other=0.0).to(tl.float32)   # [BLOCK_N, D]
        v = tl.load(v_cache + at, mask=ok[:, None], other=0.0).to(tl.float32)
        score = tl.dot(q, tl.trans(k), input_precision="ieee") * scale         # [BLOCK_H, BLOCK_N]
        score = tl.where(ok[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 1))
        alpha = tl.exp(m - m_new)                                  # rescales what was summed so far
        p = tl.exp(score - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new

    # An empty split (a context shorter than num_splits) leaves l == 0 and acc == 0: its output is
    # 0 and its log-sum-exp -inf, so it weighs nothing in stage 2.
    at = b * stride_pb + heads * stride_ph + s
    tl.store(part_lse + at, tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf")), mask=head_ok)
    tl.store(part_out + at[:, None] * HEAD_DIM + d[None, :], acc / tl.where(l > 0, l, 1.0)[:, None],
             mask=head_ok[:, None])


@triton.jit
def decode_reduce_kernel(part_out, part_lse, out, stride_pb, stride_ph, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    at = b * stride_pb + h * stride_ph + s
    lse = tl.load(part_lse + at, mask=s < NUM_SPLITS, other=float("-inf"))                  # [S]
    o = tl.load(part_out + at[:, None] * HEAD_DIM + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    w = tl.exp(lse - tl.max(lse, 0))                               # each split's share of the softmax
    tl.store(out + b * stride_ot + h * stride_oh + d, tl.sum(o * w[:, None], 0) / tl.sum(w, 0))


def num_splits_for(max_context: int) -> int:
    """Splits of the context for a step whose longest context is `max_context` positions."""
    return max(1, min(MAX_SPLITS, -(-max_context // SPLIT_TOKENS)))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                           kv_lens: torch.Tensor, scale: float, page_size: int = 1,
                           num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its whole context, read through `table`.

    query [B, heads, head_dim] (sequence b's new token, its K/V already in the cache); caches: one
    layer's [slots, kv_heads, head_dim]; table [B, >= ceil(L_b / page_size)] int64: a block table of
    pages (page_size > 1) or of slots (page_size 1, a `req_to_token` row); kv_lens [B] int64, L_b >= 1.
    num_splits: None picks by the table's width (`num_splits_for`). Returns [B, heads, head_dim]."""
    check_launch(query.device)
    check_rows(query=query, k_cache=k_cache, v_cache=v_cache, table=table)
    check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, table=table, kv_lens=kv_lens)
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    splits = num_splits_for(table.shape[1] * page_size) if num_splits is None else num_splits
    part_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=query.device)
    decode_kernel[(batch, kv_heads, splits)](
        query, k_cache, v_cache, table, kv_lens, part_out, part_lse, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N)
    out = torch.empty(batch, heads, head_dim, dtype=query.dtype, device=query.device)
    decode_reduce_kernel[(batch, heads)](
        part_out, part_lse, out, part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits))
    return out
