"""The `decode_kernel` part (chapter 5, on the GPU): stage 1 of the paged decode kernel, in Triton.

The package's own is `kvlearn.kernels.decode.decode_kernel` (imported, with triton, only when asked:
`kvlearn.kernels.DECODE_KERNEL`). `paged_decode_attention(..., stage1=kernel)` launches a part in
its place, with the same launcher and stage 2; `Engine(..., attention_backend="triton",
parts={"decode_kernel": kernel})` serves every decode step with it.
"""

from __future__ import annotations

from typing import Protocol


class DecodeKernelPart(Protocol):
    """A `@triton.jit` kernel with `decode_kernel`'s parameters, by name and in order (copy its
    signature); grid [B, kv_heads, num_splits]. Program (b, g, s):

    - serves sequence b's query heads g * GROUP .. g * GROUP + GROUP - 1, which read KV head g;
    - covers split s of b's kv_len = kv_lens[b] positions: start = s * cdiv(kv_len, num_splits),
      end = min(start + that, kv_len); a split may be empty (start >= end);
    - position pos lives at slot table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE (PAGE_SIZE 1:
      the row holds slots), its K and V at [slot, g, :] of k_cache and v_cache; it reads no other slot;
    - scores q . k * scale, softmax over start .. end - 1 (a position at or past end weighs nothing),
      kept online: running max m, sum l of exp(score - m), acc of exp(score - m) * V, the sums
      rescaled by exp(m_old - m_new) when the max grows;
    - writes acc / l to part_out[b, head, s] and the log-sum-exp m + log(l) to part_lse[b, head, s]
      (an empty split: 0 and -inf), so that stage 2 merges the splits into softmax attention.

    `kvlearn.parts.check("decode_kernel", kernel)` runs it in Triton's interpreter against attention
    computed one query at a time, on a pool whose other slots are poisoned.
    """
