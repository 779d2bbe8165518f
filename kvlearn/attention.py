"""Paged attention: the model reads and writes K and V in the pool through slot indices.

Several sequences run in one forward, packed into a single row of new tokens (varlen): some may
be prefilling (many new tokens, maybe after a cached prefix), others decoding (one new token).
For every layer the attention function

1. writes the new tokens' K and V into the pool at `slot_mapping` (one scatter),
2. gathers each sequence's whole context through its slot indices into a padded `[B, Lmax]` layout
   (one gather),
3. runs one SDPA over all sequences, with a boolean mask that lets a query see the keys at or before
   its own position in its own sequence, and never the padding.

Padding costs work: every sequence is padded to the longest new tokens and the longest context of
the step. One 1,500-token prompt beside sixteen decodes would make SDPA score sixteen padded
1,500-row blocks for nothing, and one decode over a 1,500-token context would make the fifteen
others over 60 tokens gather 1,500 each. So when lengths differ that much, the step's sequences
are attended in groups of similar lengths (`PAD_RATIO`), each padded only to its own longest: the
same attention, computed per group.

When every sequence of a decode step starts with the same slots (a prefix cache shared a system
prompt), step 2 would copy that prefix once per sequence. Then the shared slots are gathered once,
every query is scored against them in one product, and only each sequence's own tail is gathered
per sequence; one softmax runs over both parts, so the result is the same attention (cascade
attention, as FlashInfer and SGLang do for shared prefixes). Steps with a prefill keep the single
SDPA: there the products, not the copies, dominate, and SDPA's fused kernel does them better.

It plugs into transformers through its public extension points: the function is registered with
`AttentionInterface` under `ATTN_IMPLEMENTATION`, and the same name maps to a mask builder that
returns None in `AttentionMaskInterface` (the mask is ours, built once per step in
`AttentionMetadata`). The pool and the metadata arrive as extra keyword arguments of the model's
forward, which transformers hands through to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "kvlearn_paged"
# Sequences are attended in one group while the shortest new-token count and context in it are at
# least the longest's divided by this (prefills and decodes never share a group when a step has both).
PAD_RATIO = 2
# A shared prefix shorter than this is gathered per sequence like the rest: below it, the extra
# products of the cascade cost more than the copies they save.
SHARED_MIN = 32


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything one packed step needs, as tensors; T new tokens in all, B sequences.

    positions     [T]          absolute position of each new token in its sequence (for RoPE)
    slot_mapping  [T]          pool slot where each new token's K and V are written
    kv_indices    [B, Lmax]    slots of each sequence's whole context, right-padded with slot 0
    kv_lens       [B]          context length of each sequence (cached prefix + new tokens)
    query_index   [B, Qmax]    for each sequence's i-th new token, its place in the packed row (padding: 0)
    query_slots   [T]          where each packed token sits in the flattened [B * Qmax] padded layout
    mask          [B, 1, Qmax, Lmax]  True where a query may attend to a key
    last_token    [B]          place in the packed row of each sequence's last new token
    shared_len    int          in a decode step (one new token each, B > 1), the leading context slots
                               identical in every sequence; 0 below SHARED_MIN and in steps with a prefill
    parts         ()           or, when lengths differ by more than PAD_RATIO, one (tokens, metadata) per
                               group of similar sequences: the group's places in the packed row, and
                               its own metadata, padded only to its own longest
    cascade_index [P + B*(Lmax-P)]  with shared_len P > 0: the slots a cascade gathers, the shared
                               prefix once and then each sequence's own (padded) rest; else None
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    query_index: torch.Tensor
    query_slots: torch.Tensor
    mask: torch.Tensor
    last_token: torch.Tensor
    shared_len: int = 0
    parts: tuple = ()
    cascade_index: torch.Tensor | None = None

    @classmethod
    def build(cls, query_lens: list[int], kv_indices: list[torch.Tensor], device=None) -> "AttentionMetadata":
        """Metadata for sequences with `query_lens[i]` new tokens and context slots `kv_indices[i]`
        (the new tokens are the last `query_lens[i]` of that context). Inputs are trusted here; the
        runner validates them."""
        device = kv_indices[0].device if device is None else device
        q_lens = torch.tensor(query_lens, dtype=torch.int64, device=device)
        kv_lens = torch.tensor([len(ix) for ix in kv_indices], dtype=torch.int64, device=device)
        padded = torch.nn.utils.rnn.pad_sequence([ix.to(device) for ix in kv_indices], batch_first=True)
        q_max = int(q_lens.max())
        step = torch.arange(q_max, device=device)
        valid = step[None, :] < q_lens[:, None]                             # [B, Qmax]
        abs_pos = (kv_lens - q_lens)[:, None] + step[None, :]               # [B, Qmax]
        key_pos = torch.arange(padded.shape[1], device=device)
        # Causal within the sequence, and no key past its context (the padding). Padded query rows
        # see the whole context, so no row is all False (which would make SDPA return NaN).
        mask = (key_pos[None, None, :] <= abs_pos[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
        # The shared prefix of a decode step: slots equal to sequence 0's, before every new token.
        shared_len = 0
        if q_max == 1 and len(kv_indices) > 1:
            cached = int(kv_lens.min()) - 1
            shared_len = int((padded[:, :cached] == padded[:1, :cached]).all(0).int().cumprod(0).sum())
            shared_len = shared_len if shared_len >= SHARED_MIN else 0
        parts = ()
        groups = _similar_groups(query_lens, kv_lens.tolist())
        if len(groups) > 1:
            starts = (q_lens.cumsum(0) - q_lens).tolist()
            parts = tuple((torch.tensor([starts[i] + j for i in g for j in range(query_lens[i])], device=device),
                           cls.build([query_lens[i] for i in g], [kv_indices[i] for i in g], device))
                          for g in groups)
        query_index = torch.zeros_like(abs_pos)
        query_index[valid] = torch.arange(int(q_lens.sum()), device=device)
        positions = abs_pos[valid]
        return cls(
            positions=positions,
            slot_mapping=padded.gather(1, abs_pos.clamp(max=padded.shape[1] - 1))[valid],
            kv_indices=padded,
            kv_lens=kv_lens,
            query_index=query_index,
            query_slots=valid.reshape(-1).nonzero().squeeze(1),
            mask=mask[:, None],
            last_token=q_lens.cumsum(0) - 1,
            shared_len=shared_len,
            parts=parts,
            cascade_index=torch.cat([padded[0, :shared_len], padded[:, shared_len:].reshape(-1)]) if shared_len else None,
        )

    def __repr__(self) -> str:
        slots = self.slot_mapping.tolist()
        shown = str(slots) if len(slots) <= 10 else f"[{', '.join(map(str, slots[:4]))}, ..., " \
            f"{', '.join(map(str, slots[-4:]))}]"
        return (f"AttentionMetadata(seqs={self.kv_lens.numel()}, new_tokens={len(slots)}, "
                f"kv_lens={self.kv_lens.tolist()}, slot_mapping={shown}, shared_len={self.shared_len})")


def paged_attention(query, key, value, layer: int, kv_pool, md: AttentionMetadata, scale=None) -> torch.Tensor:
    """Store the new K/V of `layer` in the pool, then attend over each sequence's context read back
    from it. query: [T, heads, head_dim] (RoPE applied); key, value: [T, kv_heads, head_dim].
    Returns [T, heads, head_dim], the packed row in the same order as the queries."""
    kv_pool.write(layer, md.slot_mapping, key, value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if md.parts:  # every new token's K/V is in the pool now: each group reads what it needs
        out = torch.empty_like(query)
        for tokens, part in md.parts:
            out[tokens] = _attend(query[tokens], kv_pool.k[layer], kv_pool.v[layer], part, scale)
        return out
    return _attend(query, kv_pool.k[layer], kv_pool.v[layer], md, scale)


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


def _attend(query, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the packed queries over the contexts `md` describes, read from the caches."""
    if md.shared_len:
        return _cascade_attention(query, k_cache, v_cache, md, scale)
    q = query[md.query_index].transpose(1, 2)                             # [B, heads, Qmax, D]
    k, v = _gather(k_cache, md.kv_indices, query.dtype), _gather(v_cache, md.kv_indices, query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=md.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, *query.shape[1:])[md.query_slots]


def _gather(cache: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """cache[indices] for [B, L] indices as [B, kv_heads, L, D]. index_select on the flattened
    indices is several times faster than advanced indexing on CPU."""
    rows = cache.index_select(0, indices.reshape(-1)).view(*indices.shape, *cache.shape[1:])
    return rows.transpose(1, 2).to(dtype)


def _cascade_attention(query, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention (query [B, heads, D], one new token per sequence) over contexts whose first
    `md.shared_len` slots are the same for all: one gather of the shared prefix and every sequence's
    own rest (`md.cascade_index`), the prefix scored once for the whole batch, one softmax over both
    parts. Query head h reads KV head h // (heads // kv_heads), as in SDPA's enable_gqa. Every product
    is batched over a leading dimension of views, so a layer costs a dozen tensor operations."""
    batch, heads, dim = query.shape
    kv_heads, shared = k_cache.shape[1], md.shared_len
    group = heads // kv_heads                                              # query heads per KV head
    k, v = (c.index_select(0, md.cascade_index).to(query.dtype) for c in (k_cache, v_cache))
    k_shared, v_shared = k[:shared].transpose(0, 1), v[:shared].transpose(0, 1)           # [kv, P, D]
    k_own, v_own = (x[shared:].view(batch, -1, kv_heads, dim).transpose(1, 2) for x in (k, v))  # [B, kv, L-P, D]
    q = query.reshape(batch, kv_heads, group, dim)
    s_shared = q.transpose(0, 1).reshape(kv_heads, batch * group, dim) @ k_shared.transpose(1, 2)
    s_own = (q @ k_own.transpose(2, 3)).transpose(0, 1)                    # [kv, B, group, L-P]
    scores = torch.cat([s_shared.view(kv_heads, batch, group, shared), s_own], dim=-1).float() * scale
    scores = scores.masked_fill(~md.mask[:, 0].view(1, batch, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)                 # [kv, B, group, L]
    out = (probs[..., :shared].reshape(kv_heads, batch * group, shared) @ v_shared).view(kv_heads, batch, group, dim)
    out = out.transpose(0, 1) + probs[..., shared:].transpose(0, 1) @ v_own  # [B, kv, group, D]
    return out.reshape(batch, heads, dim)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                            kv_pool, attn_metadata: AttentionMetadata, **kwargs):
    """`paged_attention` in the form transformers calls: query [1, heads, T, head_dim], key and
    value [1, kv_heads, T, head_dim]; returns ([1, T, heads, head_dim], None)."""
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          module.layer_idx, kv_pool, attn_metadata, scaling)
    return out.unsqueeze(0), None


def _no_dense_mask(*args, **kwargs):
    """The model must not build a [T, T] mask for the packed row: attention builds its own."""
    return None


def register() -> str:
    """Make `ATTN_IMPLEMENTATION` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_dense_mask)
    return ATTN_IMPLEMENTATION
