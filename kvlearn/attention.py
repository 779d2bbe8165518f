"""Paged attention: the model reads and writes K and V in the pool through slot indices.

Several sequences run in one forward, packed into a single row of new tokens (varlen): some may
be prefilling (many new tokens, maybe after a cached prefix), others decoding (one new token).
For every layer the attention function

1. writes the new tokens' K and V into the pool at `slot_mapping` (one scatter),
2. gathers each sequence's whole context through its slot indices into a padded `[B, Lmax]` layout
   (one gather),
3. runs one SDPA over all sequences, with a boolean mask that lets a query see the keys at or before
   its own position in its own sequence, and never the padding.

Every sequence is padded to the longest new tokens and the longest context of the step: simple, and
the same attention for every query. The engine's fast path (`kvlearn.fast.attention`, chapter 6)
cuts that padding and the copies of a shared prefix; it computes the same attention.

It plugs into transformers through its public extension points: the function is registered with
`AttentionInterface` under `ATTN_IMPLEMENTATION`, and the same name maps to a mask builder that
returns None in `AttentionMaskInterface` (the mask is ours, built once per step in
`AttentionMetadata`). The pool and the metadata arrive as extra keyword arguments of the model's
forward, which transformers hands through to every attention call; so does `attention_fn`, the
function that does the work in every layer (`paged_attention` unless the runner was given another,
`kvlearn.parts.AttentionPart`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "kvlearn_paged"


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
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    query_index: torch.Tensor
    query_slots: torch.Tensor
    mask: torch.Tensor
    last_token: torch.Tensor

    @classmethod
    def build(cls, query_lens: list[int], kv_indices: list[torch.Tensor], device=None) -> AttentionMetadata:
        """Metadata for sequences with `query_lens[i]` new tokens and context slots `kv_indices[i]`
        (the new tokens are the last `query_lens[i]` of that context). Inputs are trusted here; the
        runner validates them."""
        device = kv_indices[0].device if device is None else device
        q_lens = torch.tensor(query_lens, dtype=torch.int64, device=device)
        kv_lens = torch.tensor([len(ix) for ix in kv_indices], dtype=torch.int64, device=device)
        padded = torch.nn.utils.rnn.pad_sequence([ix.to(device) for ix in kv_indices], batch_first=True)
        step = torch.arange(int(q_lens.max()), device=device)
        valid = step[None, :] < q_lens[:, None]                             # [B, Qmax]
        abs_pos = (kv_lens - q_lens)[:, None] + step[None, :]               # [B, Qmax]
        key_pos = torch.arange(padded.shape[1], device=device)
        # Causal within the sequence, and no key past its context (the padding). Padded query rows
        # see the whole context, so no row is all False (which would make SDPA return NaN).
        mask = (key_pos[None, None, :] <= abs_pos[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
        query_index = torch.zeros_like(abs_pos)
        query_index[valid] = torch.arange(int(q_lens.sum()), device=device)
        return cls(
            positions=abs_pos[valid],
            slot_mapping=padded.gather(1, abs_pos.clamp(max=padded.shape[1] - 1))[valid],
            kv_indices=padded,
            kv_lens=kv_lens,
            query_index=query_index,
            query_slots=valid.reshape(-1).nonzero().squeeze(1),
            mask=mask[:, None],
            last_token=q_lens.cumsum(0) - 1,
        )

    def __repr__(self) -> str:
        slots = self.slot_mapping.tolist()
        shown = str(slots) if len(slots) <= 10 else f"[{', '.join(map(str, slots[:4]))}, ..., " \
            f"{', '.join(map(str, slots[-4:]))}]"
        return (f"AttentionMetadata(seqs={self.kv_lens.numel()}, new_tokens={len(slots)}, "
                f"kv_lens={self.kv_lens.tolist()}, slot_mapping={shown})")


def paged_attention(query, key, value, layer: int, kv_pool, md: AttentionMetadata, scale=None) -> torch.Tensor:
    """Store the new K/V of `layer` in the pool, then attend over each sequence's context read back
    from it. query: [T, heads, head_dim] (RoPE applied); key, value: [T, kv_heads, head_dim].
    Returns [T, heads, head_dim], the packed row in the same order as the queries."""
    kv_pool.write(layer, md.slot_mapping, key, value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return attend(query, kv_pool.k[layer], kv_pool.v[layer], md, scale, kv_pool.format.decode)


def attend(query, k_cache, v_cache, md: AttentionMetadata, scale: float, decode=None) -> torch.Tensor:
    """Attention of the packed queries [T, heads, head_dim] over the contexts `md` describes, read
    from the caches (one layer's [slots, kv_heads, row]) that already hold every new token's K/V.
    decode(rows, dtype): the pool's format (`KVPool.format.decode`; None: rows are K and V as they are)."""
    q = query[md.query_index].transpose(1, 2)                             # [B, heads, Qmax, D]
    k, v = (_gather(c, md.kv_indices, query.dtype, decode) for c in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=md.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, *query.shape[1:])[md.query_slots]


def _gather(cache: torch.Tensor, indices: torch.Tensor, dtype, decode=None) -> torch.Tensor:
    """cache[indices] for [B, L] indices as [B, kv_heads, L, D], decoded. index_select on the flattened
    indices is several times faster than advanced indexing on CPU."""
    rows = cache.index_select(0, indices.reshape(-1))
    rows = rows.to(dtype) if decode is None else decode(rows, dtype)
    return rows.view(*indices.shape, *rows.shape[1:]).transpose(1, 2)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                            kv_pool, attn_metadata: AttentionMetadata, attention_fn=paged_attention, **kwargs):
    """`paged_attention` (or `attention_fn`, a function with its signature: a learner's part) in the
    form transformers calls: query [1, heads, T, head_dim], key and value [1, kv_heads, T, head_dim];
    returns ([1, T, heads, head_dim], None)."""
    out = attention_fn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
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
