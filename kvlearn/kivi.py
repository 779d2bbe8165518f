"""Chapter 10: kv_cache_dtype "int4", KIVI's layout stored in the pool (a group of tokens is a page).

A few key channels carry outliers (chapter 10, section 5), so one scale per token would spend all of
int4's 16 levels on them. KIVI quantizes keys per channel instead, over a group of tokens, and values
per token; both asymmetric (codes 0..15 over [min, max]). Here a group is one page of `GROUP` tokens:

- V is quantized as it is written, each token alone: a V row is head_dim/2 bytes of codes (two per
  byte, the even channel in the low half), then its float32 scale and minimum.
- K waits. A channel's scale needs the whole page, so a page's exact K and V stay in `window` (one
  tensor per page, in the model's dtype) until its last slot is written; then its keys are quantized
  per channel, and each of the page's 16 slots keeps head_dim/16 channels' float16 scale and minimum
  after its codes. K and V rows have one length, so 8 bytes of a V row go unused (head_dim 64).
- A query reads the pages before its own dequantized and its own page exact (`kivi_attention`), as KIVI
  reads its full-precision window: which version a query sees depends on positions only, so chunked
  prefill, prefix hits and the tiers give the tokens of one long prefill.

Invariants: a whole page's bytes depend on that page's exact K and V alone, so a cached page equals a
recomputed one (a radix tree and a block table share whole pages only); `window` holds the pages that
are partly written, and those that filled in the last step, until the next step begins.
The window is extra memory, not counted in `bytes_per_token`: at most one page per running sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlearn.quant import asymmetric

GROUP = 16     # tokens per key group: the pool's page_size


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two int4 codes (0..15, any dtype) a byte: [..., D] -> [..., D/2] uint8, the even channel in the low half."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


def check_pages(pool) -> None:
    if pool.page_size != GROUP:
        raise ValueError(f"kv_cache_dtype 'int4' quantizes keys over a page of {GROUP} tokens, so the pool needs "
                         f"page_size={GROUP}, not {pool.page_size}: Engine(..., page_size={GROUP}).")


class KiviFormat:
    """kv_cache_dtype "int4": the pool's rows (uint8, head_dim/2 + head_dim/4 bytes) and its window."""

    dtype = torch.uint8

    def __init__(self, dtype: torch.dtype, head_dim: int):
        if head_dim % GROUP or head_dim < 2 * GROUP:
            raise ValueError(f"int4 keeps a page's per-channel scales in its {GROUP} slots, so head_dim must be a "
                             f"multiple of {GROUP} and at least {2 * GROUP}; got {head_dim}: use 'int8'.")
        self.head_dim, self.row = head_dim, head_dim // 2 + head_dim // 4
        self.window: dict[int, torch.Tensor] = {}   # page -> [layers, 2, GROUP, kv_heads, head_dim], exact
        self.filled: list[int] = []                  # pages whose last slot the last step wrote

    def encode(self, x, *args):
        raise ValueError("An int4 pool is written and read by its own attention, kvlearn.kivi.kivi_attention (a "
                         "key's scale needs its whole page): serve it with Engine(..., kv_cache_dtype='int4', "
                         "page_size=16), or give ModelRunner(..., attention=pool.format.attention_for(pool)).")

    decode = encode

    def attention_for(self, pool):
        """The attention that reads this format in `pool` (chapter 5's signature): `kivi_attention`;
        ValueError unless the pool's pages are key groups."""
        check_pages(pool)
        return kivi_attention

    def write(self, pool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's K and V of `layer` at `slots` (a sequence's slots in token order): V quantized,
        K and V exact in the window, and the keys of every page this write fills quantized per channel."""
        check_pages(pool)
        if layer == 0:
            self.forget(pool)
        codes, scale, lo = asymmetric(v.float(), -1, 4)
        rows = torch.zeros(*v.shape[:-1], self.row, dtype=torch.uint8, device=v.device)
        rows[..., :self.head_dim // 2] = pack(codes)
        rows[..., self.head_dim // 2:self.head_dim // 2 + 8] = torch.cat([scale, lo], -1).view(torch.uint8)
        pool.v[layer].index_copy_(0, slots, rows)
        pages, counts = torch.unique_consecutive(slots // GROUP, return_counts=True)
        self.filled, first = [], 0
        for page, n in zip(pages.tolist(), counts.tolist(), strict=True):
            offset = int(slots[first]) % GROUP
            if offset == 0 and layer == 0:   # a page's first write (layer 0 comes first): a new page
                self.window[page] = k.new_zeros(pool.num_layers, 2, GROUP, *k.shape[1:])
            self.window[page][layer, :, offset:offset + n] = torch.stack([k[first:first + n], v[first:first + n]])
            if offset + n == GROUP:
                self.filled.append(page)
            first += n
        if self.filled:
            exact = torch.stack([self.window[page][layer, 0] for page in self.filled])   # [pages, GROUP, H, D]
            pool.k[layer].index_copy_(0, pool.slots_of(torch.tensor(self.filled, device=slots.device)),
                                      self.page_rows(exact.float()).flatten(0, 1))

    def page_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """The K rows [pages, GROUP, H, row] of whole pages of keys [pages, GROUP, H, D]: codes per
        channel over the page, and slot i keeps channels [i*D/16, (i+1)*D/16)'s float16 scale and minimum."""
        codes, scale, lo = asymmetric(keys, 1, 4, torch.float16)
        params = torch.cat([scale, lo], 1).half().view(torch.uint8)                # [pages, 2, H, 2D] bytes
        params = params.transpose(1, 2).reshape(*params.shape[:1], params.shape[2], GROUP, -1).transpose(1, 2)
        return torch.cat([pack(codes), params], -1)

    def keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Keys [..., GROUP, H, D] (float32) of whole pages of K rows [..., GROUP, H, row]."""
        half = self.head_dim // 2
        params = rows[..., half:].transpose(-3, -2).flatten(-2).contiguous().view(torch.float16).float()
        scale, lo = params.unflatten(-1, (2, self.head_dim)).unbind(-2)            # [..., H, D] each
        return unpack(rows[..., :half]).float() * scale.unsqueeze(-3) + lo.unsqueeze(-3)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """Values [..., D] (float32) of V rows [..., row]."""
        half = self.head_dim // 2
        scale, lo = rows[..., half:half + 8].contiguous().view(torch.float32).unbind(-1)
        return unpack(rows[..., :half]).float() * scale[..., None] + lo[..., None]

    def forget(self, pool) -> None:
        """Drop from the window the pages the last step filled, and pages given back to the pool."""
        for page in self.filled:
            self.window.pop(page, None)
        if self.window:
            pages = torch.tensor(list(self.window), device=pool.device)
            for page in pages[pool.allocator.is_free(pages)].tolist():
                del self.window[page]


def kivi_attention(query, key, value, layer: int, kv_pool, md, scale=None) -> torch.Tensor:
    """Chapter 5's paged attention (its signature) over an int4 pool: each query reads the pages before
    its own dequantized, and its own page, the keys up to itself, exact from the window."""
    fmt = kv_pool.format
    fmt.write(kv_pool, layer, md.slot_mapping, key, value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    B, L = md.kv_indices.shape
    pages = -(-L // GROUP)
    slots = F.pad(md.kv_indices, (0, pages * GROUP - L))                        # [B, pages * GROUP]
    k_rows = kv_pool.k[layer].index_select(0, slots.reshape(-1)).view(B, pages, GROUP, *kv_pool.k[layer].shape[1:])
    k_old = fmt.keys(k_rows).flatten(1, 2)                                      # [B, L', H, D]
    v_old = fmt.values(kv_pool.v[layer].index_select(0, slots.reshape(-1))).view_as(k_old)
    query_lens = torch.diff(md.last_token, prepend=md.last_token.new_tensor([-1]))
    q_pos = (md.kv_lens - query_lens)[:, None] + torch.arange(md.query_index.shape[1], device=slots.device)
    first = (md.kv_lens - query_lens) // GROUP                # each sequence's first page in this step
    own_pages = -(-md.kv_lens // GROUP) - first               # the pages its queries are on: in the window
    exact = k_old.new_zeros(2, B, int(own_pages.max()) * GROUP, *k_old.shape[2:])
    for b, (f, n) in enumerate(zip(first.tolist(), own_pages.tolist(), strict=True)):
        for i in range(n):
            exact[:, b, i * GROUP:(i + 1) * GROUP] = fmt.window[int(slots[b, (f + i) * GROUP]) // GROUP][layer]

    def visible(k_pos, own: bool):   # [B, Qmax, keys]: causal, inside the context, on the query's page or before
        seen = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos < md.kv_lens[:, None])[:, None, :]
        same = (k_pos // GROUP)[:, None, :] == (q_pos // GROUP)[:, :, None]
        return seen & (same if own else ~same)

    old_pos = torch.arange(pages * GROUP, device=slots.device).expand(B, -1)
    exact_pos = first[:, None] * GROUP + torch.arange(exact.shape[2], device=slots.device)
    mask = torch.cat([visible(old_pos, False), visible(exact_pos, True)], -1)[:, None]   # [B, 1, Qmax, keys]
    k = torch.cat([k_old, exact[0]], 1).transpose(1, 2).to(query.dtype)
    v = torch.cat([v_old, exact[1]], 1).transpose(1, 2).to(query.dtype)
    q = query[md.query_index].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, *query.shape[1:])[md.query_slots]
