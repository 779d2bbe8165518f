"""The fast path's attention: chapter 5's paged attention with less padding and fewer copies.

Chapter 5 (`kvlearn.attention`) pads every sequence of a step to the longest new tokens and the
longest context, and gathers each sequence's whole context. The bench's workloads make two of those
costs large; this module removes them and computes the same attention.

- Padding. One 1,500-token prompt beside sixteen decodes would make SDPA score sixteen padded
  1,500-row blocks for nothing, and one decode over a 1,500-token context would make the fifteen
  others over 60 tokens gather 1,500 each. So when lengths differ that much, the step's sequences are
  attended in groups of similar lengths (`PAD_RATIO`), each padded only to its own longest and run
  through chapter 5's `attend`: the same attention, computed per group. A group has a cost of its
  own in every layer, so decode groups whose split saves little padding are joined again
  (`DECODE_PAD_SLOTS`).
- A shared prefix. When every sequence of a decode group starts with the same slots (a prefix cache
  shared a system prompt), the gather would copy that prefix once per sequence. Then the shared
  slots are gathered once, every query is scored against them in one product, and only each
  sequence's own tail is gathered per sequence; one softmax runs over both parts, so the result is
  the same attention (cascade attention, as FlashInfer and SGLang do for shared prefixes). Groups
  with a prefill keep the single SDPA: there the products, not the copies, dominate, and SDPA's
  fused kernel does them better.

Two more cuts, each the same attention. A decode group (one new token per sequence) calls SDPA on
its queries as they are, with its mask turned into an additive bias once per step, not once per
layer. A group that is one whole prompt with nothing cached attends over its own new K and V, just
written to the pool, with SDPA's causal flag: no gather and no mask to read.

`FastStep.build` plans a step once (chapter 5's metadata of the whole step, its groups and their
masks); `fast_paged_attention` runs one layer of it with no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from kvlearn.attention import AttentionMetadata, attend

# Sequences are attended in one group while the shortest new-token count and context in it are at
# least the longest's divided by this (prefills and decodes never share a group when a step has both).
PAD_RATIO = 2
# Decode groups split by PAD_RATIO are joined again where the split saves fewer padded context slots
# than this: each group costs its own gathers, SDPA call and scatter in every layer, which on 2 CPU
# cores outweighed padding up to about this many slots (multi_turn's decode step, contexts 50-129,
# ran 7-9 % faster as one group; a 400-token context beside fifteen of 60 still pays to split).
DECODE_PAD_SLOTS = 1024
# A shared prefix shorter than this is gathered per sequence like the rest: below it, the cascade's
# extra operations cost more than the copies they save (on 2 CPU cores, 128 served branching and
# few_shot 2-4 % faster than 32 and the other workloads as fast; shared_system, with ~300 shared
# tokens, was 10 % faster with the cascade than without).
SHARED_MIN = 128


@dataclass(frozen=True)
class Group:
    """Sequences attended together, planned once per step for every layer.

    tokens      their places in the step's packed row; None when the group is the whole step
    md          their chapter 5 metadata, padded only to their own longest
    kind        "cascade": a decode group whose contexts share `shared_len` >= SHARED_MIN leading
                slots; "decode": another decode group (one new token per sequence); "fresh": one
                sequence whose context is only its new tokens; "padded": the rest (chapter 5's attend)
    shared_len  with "cascade", the leading context slots identical in every sequence; else 0
    shared      with "cascade", those slots: a slice when they are one run of the pool, else a tensor
    own_index   with "cascade", [B*(Lmax-P)] each sequence's own (padded) rest of its context
    bias        with "cascade" [B, 1, Lmax-P] (the own rest), with "decode" [B, 1, 1, Lmax]: 0 where a
                query may attend, -inf elsewhere; else None
    """

    tokens: torch.Tensor | None
    md: AttentionMetadata
    kind: str = "padded"
    shared_len: int = 0
    shared: slice | torch.Tensor | None = None
    own_index: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def build(cls, tokens: torch.Tensor | None, md: AttentionMetadata, query_lens: list[int],
              kv_lens: list[int]) -> Group:
        """The group of the sequences `md` describes (`query_lens`, `kv_lens` theirs), planned."""
        if len(query_lens) == 1 and query_lens[0] == kv_lens[0] > 1:
            return cls(tokens, md, "fresh")
        if max(query_lens) > 1:
            return cls(tokens, md)
        bias = torch.zeros(md.mask.shape, dtype=torch.float32,
                           device=md.mask.device).masked_fill_(~md.mask, float("-inf"))
        if len(query_lens) == 1:
            return cls(tokens, md, "decode", bias=bias)
        # The shared prefix: slots equal to sequence 0's, before every new token.
        padded, cached = md.kv_indices, min(kv_lens) - 1
        shared_len = int((padded[:, :cached] == padded[:1, :cached]).all(0).int().cumprod(0).sum())
        if shared_len < SHARED_MIN:
            return cls(tokens, md, "decode", bias=bias)
        first = padded[0, :shared_len]
        run = bool((first == first[0] + torch.arange(shared_len, device=first.device)).all())
        shared = slice(int(first[0]), int(first[0]) + shared_len) if run else first
        return cls(tokens, md, "cascade", shared_len, shared, padded[:, shared_len:].reshape(-1),
                   bias[:, 0, :, shared_len:])


@dataclass(frozen=True)
class FastStep:
    """A step as the fast path runs it: chapter 5's metadata of the whole step (`md`: positions,
    slot_mapping, last_token) and its groups of similar sequences; every new token is in one group."""

    md: AttentionMetadata
    groups: tuple[Group, ...]

    @classmethod
    def build(cls, query_lens: list[int], kv_indices: list[torch.Tensor], device=None) -> FastStep:
        """The step `AttentionMetadata.build(query_lens, kv_indices, device)` describes, planned."""
        md = AttentionMetadata.build(query_lens, kv_indices, device)
        kv_lens = [len(ix) for ix in kv_indices]
        groups = _similar_groups(query_lens, kv_lens)
        if len(groups) == 1:
            return cls(md, (Group.build(None, md, query_lens, kv_lens),))
        device, starts = md.kv_indices.device, [0, *accumulate(query_lens)]   # sequence i's place in the row
        return cls(md, tuple(
            Group.build(torch.tensor([starts[i] + j for i in g for j in range(query_lens[i])], device=device),
                        AttentionMetadata.build([query_lens[i] for i in g], [kv_indices[i] for i in g], device),
                        [query_lens[i] for i in g], [kv_lens[i] for i in g])
            for g in groups))


def fast_paged_attention(query, key, value, layer: int, kv_pool, step: FastStep, scale: float) -> torch.Tensor:
    """`kvlearn.attention.paged_attention` over a planned step: the same inputs and result."""
    kv_pool.write(layer, step.md.slot_mapping, key, value)
    k_cache, v_cache = kv_pool.k[layer], kv_pool.v[layer]
    # A fresh prompt may read its K/V from the inputs only when the pool keeps them unrounded.
    fresh_ok = kv_pool.dtype == key.dtype
    if len(step.groups) == 1:
        return _attend_group(query, key, value, k_cache, v_cache, step.groups[0], scale, fresh_ok)
    out = torch.empty_like(query)
    for group in step.groups:  # every new token's K/V is in the pool now: each group reads what it needs
        t = group.tokens
        out[t] = _attend_group(query[t], key[t], value[t], k_cache, v_cache, group, scale, fresh_ok)
    return out


def _similar_groups(query_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar lengths: prefills apart from decodes; then, most new
    tokens first (longest context first among equals), a sequence starts a new group when its new
    tokens are under 1/PAD_RATIO of the group's most, or when the group's contexts would then differ
    by more than PAD_RATIO; decode groups are then joined where splitting saves little padding. One
    group when padding wastes little (the usual decode step)."""
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
    return _joined_decodes(groups, query_lens, kv_lens)


def _joined_decodes(groups: list[list[int]], query_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """The groups, with each decode group joined to the one before it (longer contexts) when padding
    its sequences to that group's longest context adds fewer than DECODE_PAD_SLOTS slots."""
    joined = []
    for group in groups:
        prev = joined[-1] if joined else None
        if (prev and query_lens[prev[0]] == query_lens[group[0]] == 1
                and sum(kv_lens[prev[0]] - kv_lens[i] for i in group) < DECODE_PAD_SLOTS):
            prev.extend(group)
        else:
            joined.append(group)
    return joined


def _attend_group(query, key, value, k_cache, v_cache, group: Group, scale: float, fresh_ok: bool) -> torch.Tensor:
    """The group's attention: query [T, heads, D] its new tokens, key and value [T, kv_heads, D] theirs."""
    if group.kind == "cascade":
        return _cascade_attention(query, k_cache, v_cache, group, scale)
    if group.kind == "decode":
        k, v = (c.index_select(0, group.md.kv_indices.reshape(-1)).view(*group.md.kv_indices.shape, *c.shape[1:])
                .transpose(1, 2).to(query.dtype) for c in (k_cache, v_cache))            # [B, kv, L, D]
        out = F.scaled_dot_product_attention(query[:, :, None], k, v, attn_mask=group.bias.to(query.dtype), scale=scale,
                                             enable_gqa=True)                              # [B, heads, 1, D]
        return out[:, :, 0]
    if group.kind == "fresh" and fresh_ok:
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))                  # [1, heads, T, D]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return attend(query, k_cache, v_cache, group.md, scale)


def _cascade_attention(query, k_cache, v_cache, group: Group, scale: float) -> torch.Tensor:
    """Decode attention (query [B, heads, D], one new token per sequence) over contexts whose first
    `group.shared_len` slots are the same for all: the shared prefix read once (a view of the pool
    when its slots are one run) and scored once for the whole batch, every sequence's own rest
    gathered (`group.own_index`), one softmax over both parts. Query head h reads KV head
    h // (heads // kv_heads), as in SDPA's enable_gqa. Everything is laid out KV head first
    ([kv, ...]) so that every product is a `bmm` over views, without copies."""
    batch, heads, dim = query.shape
    kv_heads, shared = k_cache.shape[1], group.shared_len
    per_kv = heads // kv_heads                                             # query heads per KV head
    if isinstance(group.shared, slice):
        k_shared, v_shared = k_cache[group.shared], v_cache[group.shared]
    else:
        k_shared, v_shared = k_cache.index_select(0, group.shared), v_cache.index_select(0, group.shared)
    k_shared, v_shared = (x.to(query.dtype).transpose(0, 1) for x in (k_shared, v_shared))     # [kv, P, D]
    k_own, v_own = (c.index_select(0, group.own_index).to(query.dtype).view(batch, -1, kv_heads, dim)
                    .permute(2, 0, 1, 3).reshape(kv_heads * batch, -1, dim)
                    for c in (k_cache, v_cache))  # [kv*B, L-P, D]
    q = query.reshape(batch, kv_heads, per_kv, dim).transpose(0, 1).reshape(kv_heads, batch * per_kv, dim)
    s_shared = torch.bmm(q, k_shared.transpose(1, 2)).view(kv_heads, batch, per_kv, shared)
    s_own = torch.bmm(q.view(kv_heads * batch, per_kv, dim), k_own.transpose(1, 2))
    s_own = s_own.view(kv_heads, batch, per_kv, -1).add_(group.bias.to(query.dtype)[None])   # [kv, B, per_kv, L-P]
    scores = torch.cat([s_shared, s_own], dim=-1).float().mul_(scale)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)                 # [kv, B, per_kv, L]
    out = torch.bmm(probs[..., :shared].view(kv_heads, batch * per_kv, shared), v_shared)
    own = torch.bmm(probs[..., shared:].view(kv_heads * batch, per_kv, -1), v_own)
    out = (out.view(kv_heads, batch, per_kv, dim) + own.view(kv_heads, batch, per_kv, dim)).transpose(0, 1)
    return out.reshape(batch, heads, dim)
