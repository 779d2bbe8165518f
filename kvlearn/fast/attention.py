"""The fast path's attention: chapter 5's paged attention with less padding and fewer copies.

Chapter 5 (`kvlearn.attention`) pads every sequence of a step to the longest new tokens and the
longest context, and gathers each sequence's whole context. The bench's workloads make two of those
costs large; this module removes them and computes the same attention.

- Padding. One 1,500-token prompt beside sixteen decodes would make SDPA score sixteen padded
  1,500-row blocks for nothing, and one decode over a 1,500-token context would make the fifteen
  others over 60 tokens gather 1,500 each. So when lengths differ that much, the step's sequences are
  attended in groups of similar lengths (`PAD_RATIO`), each padded only to its own longest and run
  through chapter 5's `attend`: the same attention, computed per group.
- A shared prefix. When every sequence of a decode group starts with the same slots (a prefix cache
  shared a system prompt), the gather would copy that prefix once per sequence. Then the shared
  slots are gathered once, every query is scored against them in one product, and only each
  sequence's own tail is gathered per sequence; one softmax runs over both parts, so the result is
  the same attention (cascade attention, as FlashInfer and SGLang do for shared prefixes). Groups
  with a prefill keep the single SDPA: there the products, not the copies, dominate, and SDPA's
  fused kernel does them better.

`FastStep.build` plans a step once (chapter 5's metadata of the whole step, and its groups);
`fast_paged_attention` runs one layer of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from kvlearn.attention import AttentionMetadata, attend

# Sequences are attended in one group while the shortest new-token count and context in it are at
# least the longest's divided by this (prefills and decodes never share a group when a step has both).
PAD_RATIO = 2
# A shared prefix shorter than this is gathered per sequence like the rest: below it, the extra
# products of the cascade cost more than the copies they save.
SHARED_MIN = 32


@dataclass(frozen=True)
class Group:
    """Sequences attended together.

    tokens         their places in the step's packed row; None when the group is the whole step
    md             their chapter 5 metadata, padded only to their own longest
    shared_len     in a decode group (one new token each, more than one sequence), the leading
                   context slots identical in every sequence; 0 below SHARED_MIN and with a prefill
    cascade_index  [P + B*(Lmax-P)] with shared_len P > 0: the slots a cascade gathers, the shared
                   prefix once and then each sequence's own (padded) rest; else None
    """

    tokens: torch.Tensor | None
    md: AttentionMetadata
    shared_len: int = 0
    cascade_index: torch.Tensor | None = None

    @classmethod
    def build(cls, tokens: torch.Tensor | None, md: AttentionMetadata, query_lens: list[int]) -> "Group":
        """The group of the sequences `md` describes, with its shared prefix found."""
        if max(query_lens) > 1 or len(query_lens) == 1:
            return cls(tokens, md)
        # The shared prefix: slots equal to sequence 0's, before every new token.
        padded, cached = md.kv_indices, int(md.kv_lens.min()) - 1
        shared_len = int((padded[:, :cached] == padded[:1, :cached]).all(0).int().cumprod(0).sum())
        if shared_len < SHARED_MIN:
            return cls(tokens, md)
        return cls(tokens, md, shared_len, torch.cat([padded[0, :shared_len], padded[:, shared_len:].reshape(-1)]))


@dataclass(frozen=True)
class FastStep:
    """A step as the fast path runs it: chapter 5's metadata of the whole step (`md`: positions,
    slot_mapping, last_token) and its groups of similar sequences; every new token is in one group."""

    md: AttentionMetadata
    groups: tuple[Group, ...]

    @classmethod
    def build(cls, query_lens: list[int], kv_indices: list[torch.Tensor], device=None) -> "FastStep":
        """The step `AttentionMetadata.build(query_lens, kv_indices, device)` describes, planned."""
        md = AttentionMetadata.build(query_lens, kv_indices, device)
        groups = _similar_groups(query_lens, [len(ix) for ix in kv_indices])
        if len(groups) == 1:
            return cls(md, (Group.build(None, md, query_lens),))
        device, starts = md.kv_indices.device, [0, *accumulate(query_lens)]   # sequence i's place in the row
        return cls(md, tuple(
            Group.build(torch.tensor([starts[i] + j for i in g for j in range(query_lens[i])], device=device),
                        AttentionMetadata.build([query_lens[i] for i in g], [kv_indices[i] for i in g], device),
                        [query_lens[i] for i in g])
            for g in groups))


def fast_paged_attention(query, key, value, layer: int, kv_pool, step: FastStep, scale: float) -> torch.Tensor:
    """`kvlearn.attention.paged_attention` over a planned step: the same inputs and result."""
    kv_pool.write(layer, step.md.slot_mapping, key, value)
    k_cache, v_cache = kv_pool.k[layer], kv_pool.v[layer]
    if len(step.groups) == 1:
        return _attend_group(query, k_cache, v_cache, step.groups[0], scale)
    out = torch.empty_like(query)
    for group in step.groups:  # every new token's K/V is in the pool now: each group reads what it needs
        out[group.tokens] = _attend_group(query[group.tokens], k_cache, v_cache, group, scale)
    return out


def _similar_groups(query_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar lengths: prefills apart from decodes; then, most new
    tokens first (longest context first among equals), a sequence starts a new group when its new
    tokens are under 1/PAD_RATIO of the group's most, or when the group's contexts would then differ
    by more than PAD_RATIO. One group when padding wastes little (the usual decode step)."""
    groups = []
    for kind in ([i for i, q in enumerate(query_lens) if q > 1], [i for i, q in enumerate(query_lens) if q == 1]):
        group, shortest, longest = [], 0, 0
        for i in sorted(kind, key=lambda i: (-query_lens[i], -kv_lens[i])):
            if group and (query_lens[i] * PAD_RATIO < query_lens[group[0]]
                          or max(longest, kv_lens[i]) > PAD_RATIO * min(shortest, kv_lens[i])):
                groups.append(group)
                group = []
            if not group:
                shortest = longest = kv_lens[i]
            group.append(i)
            shortest, longest = min(shortest, kv_lens[i]), max(longest, kv_lens[i])
        if group:
            groups.append(group)
    return groups


def _attend_group(query, k_cache, v_cache, group: Group, scale: float) -> torch.Tensor:
    if group.shared_len:
        return _cascade_attention(query, k_cache, v_cache, group, scale)
    return attend(query, k_cache, v_cache, group.md, scale)


def _cascade_attention(query, k_cache, v_cache, group: Group, scale: float) -> torch.Tensor:
    """Decode attention (query [B, heads, D], one new token per sequence) over contexts whose first
    `group.shared_len` slots are the same for all: one gather of the shared prefix and every
    sequence's own rest (`group.cascade_index`), the prefix scored once for the whole batch, one
    softmax over both parts. Query head h reads KV head h // (heads // kv_heads), as in SDPA's
    enable_gqa. Every product is batched over a leading dimension of views, so a layer costs a dozen
    tensor operations."""
    batch, heads, dim = query.shape
    kv_heads, shared = k_cache.shape[1], group.shared_len
    per_kv = heads // kv_heads                                             # query heads per KV head
    k, v = (c.index_select(0, group.cascade_index).to(query.dtype) for c in (k_cache, v_cache))
    k_shared, v_shared = k[:shared].transpose(0, 1), v[:shared].transpose(0, 1)           # [kv, P, D]
    k_own, v_own = (x[shared:].view(batch, -1, kv_heads, dim).transpose(1, 2) for x in (k, v))  # [B, kv, L-P, D]
    q = query.reshape(batch, kv_heads, per_kv, dim)
    s_shared = q.transpose(0, 1).reshape(kv_heads, batch * per_kv, dim) @ k_shared.transpose(1, 2)
    s_own = (q @ k_own.transpose(2, 3)).transpose(0, 1)                    # [kv, B, per_kv, L-P]
    scores = torch.cat([s_shared.view(kv_heads, batch, per_kv, shared), s_own], dim=-1).float() * scale
    scores = scores.masked_fill(~group.md.mask[:, 0].view(1, batch, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)                 # [kv, B, per_kv, L]
    out = (probs[..., :shared].reshape(kv_heads, batch * per_kv, shared) @ v_shared).view(kv_heads, batch, per_kv, dim)
    out = out.transpose(0, 1) + probs[..., shared:].transpose(0, 1) @ v_own  # [B, kv, per_kv, D]
    return out.reshape(batch, heads, dim)
