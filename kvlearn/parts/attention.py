"""The `attention` part (chapter 5): one layer's paged attention over the KV pool.

The package's own is `kvlearn.attention.paged_attention`. A part is a plain function with its
signature; the runner calls it in every layer of every forward
(`ModelRunner(model, pool, attention=fn)`, `Engine(..., parts={"attention": fn})`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvlearn.attention import AttentionMetadata


class AttentionPart(Protocol):
    """What the model runner asks of an attention function, called once per layer per step.

    `fn(query, key, value, layer, kv_pool, md, scale=None) -> out`, for the T new tokens of a packed
    step (`md`: `kvlearn.attention.AttentionMetadata`, B sequences):

    - query [T, heads, head_dim] (RoPE applied), key and value [T, kv_heads, head_dim], heads a
      multiple of kv_heads (GQA: query head h reads KV head h // (heads // kv_heads));
    - it writes the step's key and value into `layer` of the pool at `md.slot_mapping`
      (`kv_pool.write(layer, md.slot_mapping, key, value)`) and changes no other slot or layer;
    - new token t of sequence b, at position p = kv_len - query_len + t of its context, attends to
      the keys at positions 0 .. p of that sequence's context, read from the pool through its slots
      (`md.kv_indices[b, :md.kv_lens[b]]`), after the write: its own K and V are part of it;
    - scores are q . k * scale (`scale=None`: head_dim ** -0.5), softmax over those keys, weights on V;
    - returns [T, heads, head_dim] in the order of the packed row (the order of `query`).

    It must not change its arguments other than the pool. `kvlearn.parts.check("attention", fn)`
    judges it against attention computed one query at a time, slot by slot.
    """

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, kv_pool,
                 md: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
        """The step's attention output for `layer`, after writing its K and V to the pool."""
