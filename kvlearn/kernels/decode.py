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

Tiles: head_dim padded to `tile(head_dim)` with a mask (80 and 96 occur in real models); products in
the cache's dtype with float32 accumulation (`dot_dtype`). The tile loop of `decode_kernel` is the
chapter's exercise: `paged_decode_attention(..., stage1=my_kernel)` runs a `@triton.jit` kernel with
`decode_kernel`'s parameters in its place, with this launcher and stage 2 as they are.

Why split (flash-decoding): a decode step has few programs, B * kv_heads, 48 for 16 sequences of
SmolLM2, while a GPU has more than a hundred multiprocessors; splitting long contexts gives each
its own work. On a CPU in Triton's interpreter a split is only more programs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpreterError

from kvlearn.kernels.common import INTERPRETED, check_decode, check_kernel, dot_dtype, tile
from kvlearn.kernels.decode_rules import obeyed
from kvlearn.kernels.watch import AddressError, watch

BLOCK_N = 64          # context positions per tile
SPLIT_TOKENS = 512    # a context gets one split per this many positions of the step's longest ...
MAX_SPLITS = 8        # ... up to this many
# Stage 1: 4 warps, one 16 x 16 piece of a [16, 64] score tile each (SGLang's grouped decode uses 4);
# 2 stages: the next tile's K and V load while this one's softmax runs.
STAGE1_LAUNCH = dict(num_warps=4, num_stages=2)
# Stage 2: 1 warp holds [8, head_dim] numbers in a few dozen registers per thread; 1 stage: no loop.
STAGE2_LAUNCH = dict(num_warps=1, num_stages=1)


# num_splits changes as contexts grow, and the table's row stride (its width) from step to step:
# run-time arguments, not specialized (Triton would compile a value of 1, or a multiple of 16, apart),
# so one compiled kernel serves every step.
@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def decode_kernel(query, k_cache, v_cache, table, kv_lens, part_out, part_lse, scale, num_splits,
                  stride_qt, stride_qh, stride_cs, stride_ch, stride_tb, stride_pb, stride_ph, stride_ps,
                  stride_lb, stride_lh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    heads = g * GROUP + rows                                       # the query heads that read KV head g
    head_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)                                      # head_dim, padded to a power of two
    d_ok = d < HEAD_DIM
    q = tl.load(query + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)   # [BLOCK_H, BLOCK_D]
    kv_len = tl.load(kv_lens + b)
    per_split = tl.cdiv(kv_len, num_splits)
    start = s * per_split
    end = tl.minimum(start + per_split, kv_len)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)             # running max of the scores
    l = tl.zeros([BLOCK_H], tl.float32)                            # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)                 # running sum of exp(score - m) * V
    for n in range(start, end, BLOCK_N):
        # This tile's positions; the last tile runs past the split's end, so `ok` marks the real ones.
        pos = n + tl.arange(0, BLOCK_N)
        ok = pos < end
        # Each position's slot: its page from the table row, then its place in the page. In int64:
        # slot * stride passes 2**31 in a large pool, and an int32 table would wrap around.
        page = tl.load(table + b * stride_tb + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        # K and V of those slots, straight from the pool (KV head g); masked rows and dims load 0.
        at = slot[:, None] * stride_cs + g * stride_ch + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + at, mask=kv_ok, other=0.0).to(DOT_DTYPE)             # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache + at, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        # Scores: products in DOT_DTYPE, sums in float32 (ieee keeps a float32 cache's products exact,
        # where a GPU would round them to tf32; a 16-bit cache's are exact on the tensor cores anyway).
        score = tl.dot(q, tl.trans(k), input_precision="ieee") * scale             # [BLOCK_H, BLOCK_N]
        # A position past the split's end gets no weight: exp(-inf) = 0.
        score = tl.where(ok[None, :], score, float("-inf"))
        # Online softmax: a larger max rescales what was summed so far by exp(m_old - m_new).
        m_new = tl.maximum(m, tl.max(score, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")  # p cast for the dot
        m = m_new

    # An empty split (a context shorter than num_splits) leaves l == 0 and acc == 0: its output is
    # 0 and its log-sum-exp -inf, so it weighs nothing in stage 2.
    tl.store(part_lse + b * stride_lb + heads * stride_lh + s,
             tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf")), mask=head_ok)
    tl.store(part_out + b * stride_pb + heads[:, None] * stride_ph + s * stride_ps + d[None, :],
             acc / tl.where(l > 0, l, 1.0)[:, None], mask=head_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(part_out, part_lse, out, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))     # [S]
    o = tl.load(part_out + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)                                      # [S, BLOCK_D]
    w = tl.exp(lse - tl.max(lse, 0))                               # each split's share of the softmax
    tl.store(out + b * stride_ot + h * stride_oh + d, tl.sum(o * w[:, None], 0) / tl.sum(w, 0), mask=d_ok)


def num_splits_for(max_context: int) -> int:
    """Splits of the context for a step whose longest context is `max_context` positions."""
    return max(1, min(MAX_SPLITS, -(-max_context // SPLIT_TOKENS)))


@contextmanager
def guarded(kernel, tensors: tuple, page_size: int, splits: int):
    """A kernel other than `decode_kernel`, run in the interpreter, under `kvlearn.kernels.decode_rules`:
    its first access outside them raises `AddressError` (not the interpreter's wrapping of it)."""
    if kernel is decode_kernel or not INTERPRETED:
        yield
        return
    try:
        with watch(obeyed(*tensors, page_size, splits)):
            yield
    except InterpreterError as error:
        if isinstance(error.__cause__, AddressError):
            raise error.__cause__ from None
        raise


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                           kv_lens: torch.Tensor, scale: float, page_size: int = 1,
                           num_splits: int | None = None, stage1=None) -> torch.Tensor:
    """Attention of one new token per sequence over its whole context, read through `table`.

    query [B, heads, head_dim] (sequence b's new token, its K/V already in the cache); caches: one
    layer's [slots, kv_heads, head_dim], heads a multiple of kv_heads; table [B, >= ceil(L_b /
    page_size)] int64 or int32: a block table of pages (page_size > 1) or of slots (page_size 1, a
    `req_to_token` row); kv_lens [B], 1 <= L_b. num_splits: None picks by the table's width
    (`num_splits_for`). stage1: a `@triton.jit` kernel with `decode_kernel`'s parameters to run
    instead of it (the chapter's exercise); None runs `decode_kernel`. Returns [B, heads, head_dim].
    Refuses what a kernel cannot run, as `kvlearn.kernels.common` says."""
    check_decode(query, k_cache, v_cache, table, kv_lens, page_size, num_splits)
    kernel = decode_kernel if stage1 is None else check_kernel("stage1", stage1, like=decode_kernel)
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    splits = num_splits_for(table.shape[1] * page_size) if num_splits is None else num_splits
    # Room for MAX_SPLITS whatever the count, as SGLang's buffers: the strides and stage 2's tile stay
    # the same from step to step, so neither kernel compiles again.
    room = max(splits, MAX_SPLITS)
    part_out = torch.empty(batch, heads, room, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch, heads, room, dtype=torch.float32, device=query.device)
    tensors = (query, k_cache, v_cache, table, kv_lens, part_out, part_lse)
    with guarded(kernel, tensors, page_size, splits):
        kernel[(batch, kv_heads, splits)](
            *tensors, scale, splits,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size, DOT_DTYPE=dot_dtype(k_cache.dtype),
            BLOCK_H=tile(heads // kv_heads), BLOCK_D=tile(head_dim), BLOCK_N=BLOCK_N, **STAGE1_LAUNCH)
    out = torch.empty(batch, heads, head_dim, dtype=query.dtype, device=query.device)
    decode_reduce_kernel[(batch, heads)](
        part_out, part_lse, out, splits, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=tile(head_dim), BLOCK_S=triton.next_power_of_2(room),
        **STAGE2_LAUNCH)
    return out
