"""Chapter 10: fewer bytes per token. K and V stored quantized in the pool, dequantized as attention reads them.

Each format is a row codec for chapter 4's pool (`kvlearn.pool.KV_CACHE_DTYPES`, filled by
`kvlearn/__init__`): one token's K (or V) of one KV head, head_dim values, becomes a stored row and
back. Both quantized formats scale per token and KV head by the row's absolute maximum:

- "int8":     codes round(x / s), s = absmax / 127, as int8;
- "fp8_e4m3": codes x / s, s = absmax / 448 (e4m3's largest finite value), as torch.float8_e4m3fn;

and a row is its head_dim code bytes followed by the 4 bytes of its float32 scale (uint8 storage).

Invariants: a row's scale is stored in its own slot, so prefix reuse, eviction and the tiers move it
with its codes; `encode` is a pure function of the row (the same K gives the same bytes, whoever
writes it, so a cached prefix equals a recomputed one); an all-zero row decodes to zeros; codes never
leave the format's range (saturation); int8's error is at most s/2 per value, fp8's at most a 2^-4
relative step for values above its subnormals (|x| >= 2^-6 s).

`perplexity_and_kl` measures what a format costs, teacher-forced through chapter 5's paged runner;
`quality_table` does it for several formats (the first one the reference), e.g. over the chapter's
frozen text: `python -c 'import kvlearn; from kvlearn.quant import HELD_OUT_TEXT, quality_table;
m, t = kvlearn.load_model(); print(*quality_table(m, t.encode(HELD_OUT_TEXT)), sep="\\n")'`.
`Rounding`, `PerLayerScale` and `simulated_attention` compare layouts (int4 per token or KIVI's, fp8
with one scale per layer as vLLM's k_scale) by rounding K and V as attention reads them: a
simulation, said as such. The pool stores KIVI's layout
as "int4" (`kvlearn.kivi`, with its own attention).
The engine serves these formats with chapter 5's torch attention; the Triton kernels (`kvlearn.kernels`)
read "int8" too, quantizing in the store kernel and dequantizing in the tile load, fused; the fast
path reads none (`EngineConfig` refuses what cannot read a format).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvlearn.errors import check_positive_int
from kvlearn.kernels import attention_function
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner

SCALE_BYTES = 4   # one float32 scale per row


class AbsmaxFormat:
    """A per-row symmetric absmax format: codes of `code_dtype` in [-qmax, qmax], then the scale."""

    dtype = torch.uint8

    def __init__(self, head_dim: int, code_dtype: torch.dtype, qmax: float, rounds: bool):
        if head_dim % SCALE_BYTES:
            raise ValueError(f"A quantized row keeps its float32 scale after head_dim codes, so head_dim must be a "
                             f"multiple of {SCALE_BYTES}; got {head_dim}: use kv_cache_dtype 'auto' or 'bfloat16'.")
        self.head_dim, self.code_dtype, self.qmax, self.rounds = head_dim, code_dtype, qmax, rounds
        self.row = head_dim + SCALE_BYTES

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [..., head_dim] of `code_dtype`, scales [..., 1] float32) of rows x [..., head_dim]."""
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True) / self.qmax
        q = (x / torch.where(scale > 0, scale, 1.0)).clamp(-self.qmax, self.qmax)   # all-zero row: codes 0
        return (q.round() if self.rounds else q).to(self.code_dtype), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        return (codes.float() * scale).to(dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack(*self.quantize(x))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(*self.unpack(rows), dtype)

    def pack(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows [..., row] of uint8: a row's code bytes, then its scale's 4 bytes."""
        rows = torch.empty(*codes.shape[:-1], self.row, dtype=torch.uint8, device=codes.device)
        rows[..., :self.head_dim] = codes.view(torch.uint8)
        rows[..., self.head_dim:] = scale.view(torch.uint8)
        return rows

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of rows, views of their bytes."""
        return rows[..., :self.head_dim].view(self.code_dtype), rows[..., self.head_dim:].view(torch.float32)


class Int8Format(AbsmaxFormat):
    """kv_cache_dtype "int8": symmetric absmax per token and KV head. Its `quantize` and `dequantize`
    are chapter 10's part "quantizer" (kvlearn.parts.QuantizerPart), built as `Int8Format(head_dim)`."""

    def __init__(self, head_dim: int):
        super().__init__(head_dim, torch.int8, 127.0, rounds=True)


def int8_format(dtype, head_dim: int) -> Int8Format:
    """kv_cache_dtype "int8": symmetric absmax per token and KV head."""
    return Int8Format(head_dim)


def fp8_e4m3_format(dtype, head_dim: int) -> AbsmaxFormat:
    """kv_cache_dtype "fp8_e4m3": float8_e4m3fn codes, an absmax scale per token and KV head."""
    return AbsmaxFormat(head_dim, torch.float8_e4m3fn, 448.0, rounds=False)


FORMATS = {"fp8_e4m3": fp8_e4m3_format, "int8": int8_format}


def perplexity_and_kl(model, token_ids: list[int], kv_cache_dtype: str, reference: torch.Tensor | None = None,
                      chunk: int = 256, attention=None) -> tuple[float, float | None, torch.Tensor]:
    """Teacher-forced quality of a format through the paged runner: (perplexity of token_ids[1:],
    mean KL(reference || this) over positions or None without a reference, log-probs [n - 1, vocab]).
    token_ids[:-1] are prefilled as one sequence, `chunk` tokens a step (chapter 6's chunked prefill),
    keeping the logits of every position: each query reads its context, its own token included, back
    from the (quantized) pool, as in serving, through pages of 16 slots (what "int4" needs). Which bytes
    a query reads depends on positions alone, so the chunk size changes nothing but float rounding.
    `attention`: the format's (None: chapter 5's, or int4's own) or a function with chapter 5's
    signature, such as `simulated_attention(...)`."""
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"Need at least 2 tokens to score a next token, got {n}.")
    check_positive_int("chunk", chunk)
    pool = KVPool.for_model(model.config, num_slots=-(-n // 16) * 16, dtype=model.dtype, device=model.device,
                            page_size=16, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(model, pool, attention=attention or attention_function("torch", pool))
    slots = pool.alloc(pool.num_slots)
    logps = []
    with runner.active():
        for start in range(0, n - 1, chunk):
            end = min(start + chunk, n - 1)
            logits = runner.run([token_ids[start:end]], [slots[:end]], every_token=True)
            logps.append(torch.log_softmax(logits.double(), -1))
    logp = torch.cat(logps)
    nll = -logp.gather(1, torch.tensor(token_ids[1:], device=logp.device)[:, None]).mean()
    kl = None if reference is None else float((reference.exp() * (reference - logp)).sum(-1).mean())
    return math.exp(float(nll)), kl, logp


def quality_table(model, token_ids: list[int], names=("auto", "bfloat16", "fp8_e4m3", "int8", "int4")) -> list[dict]:
    """Per kv_cache_dtype: bytes_per_token, perplexity over token_ids, its change against the first
    name's (the reference, "auto": the model's own dtype) and the mean KL to its distribution."""
    table, ref = [], None
    for name in names:
        ppl, kl, logp = perplexity_and_kl(model, token_ids, name, reference=ref)
        if ref is None:
            ref, ref_ppl, kl = logp, ppl, 0.0
        pool = KVPool.for_model(model.config, num_slots=1, dtype=model.dtype, kv_cache_dtype=name)
        table.append({"kv_cache_dtype": name, "bytes_per_token": pool.bytes_per_token, "perplexity": round(ppl, 4),
                      "vs_reference_pct": round(100 * (ppl / ref_ppl - 1), 3), "mean_kl": round(kl, 6)})
    return table


# --- Simulated layouts (int4 per token, KIVI's): rounded as attention reads, not stored ----------
#
# Layouts compared before one is stored ("int4", kvlearn.kivi, is KIVI's with a page per group).
# `Rounding` rounds K and V to `bits` and back in float32 (`PerLayerScale` through fp8), the
# way a layout would store them; `simulated_attention(rounding)` is chapter 5's attention over an
# "auto" pool with each sequence's gathered context rounded just before SDPA, so perplexity_and_kl
# can score a layout without a stored format.

def round_per_token(x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """x [..., head_dim] rounded to `bits` per row (one token of one KV head) and back. Symmetric:
    codes in [-qmax, qmax], qmax = 2^(bits-1) - 1, scale absmax / qmax (for bits=8 exactly the
    pool's "int8"). Asymmetric: codes in [0, 2^bits - 1] over [min, max] of the row."""
    x = x.float()
    if symmetric:
        qmax = 2.0 ** (bits - 1) - 1
        scale = x.abs().amax(-1, keepdim=True) / qmax
        return (x / torch.where(scale > 0, scale, 1.0)).clamp(-qmax, qmax).round() * scale
    codes, scale, lo = asymmetric(x, -1, bits)
    return codes * scale + lo


def round_per_channel(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [..., tokens, head_dim] rounded asymmetrically per channel, over groups of `group`
    consecutive tokens (KIVI's keys): each channel of each group has its own [min, max]. The tokens
    after the last whole group are returned as they are."""
    x = x.float()
    whole = x.shape[-2] // group * group
    g = x[..., :whole, :].unflatten(-2, (whole // group, group))        # [..., groups, group, head_dim]
    codes, scale, lo = asymmetric(g, -2, bits)
    return torch.cat([(codes * scale + lo).flatten(-3, -2), x[..., whole:, :]], dim=-2)


def asymmetric(x: torch.Tensor, dim: int, bits: int, stored=torch.float32):
    """(codes, scale, minimum) of x (float32) rounded to `bits` asymmetrically over `dim`: codes in
    [0, 2^bits - 1] (as floats) over [min, max], scale and minimum keeping `dim` as size 1, as `stored`
    keeps them (the codes come from the stored values). A constant run has scale 0 and codes 0, so it
    comes back as its minimum. The simulated layouts round with it, and so does the pool's "int4"
    (kvlearn.kivi, with float16 key scales)."""
    levels = 2.0 ** bits - 1
    lo = x.amin(dim, keepdim=True).to(stored).float()
    scale = ((x.amax(dim, keepdim=True) - lo) / levels).to(stored).float()
    return ((x - lo) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, levels), scale, lo


class Rounding:
    """A simulated layout: how K and V of a sequence's context are rounded.

    keys: "token" (per token and KV head, over head_dim) or "channel" (per channel, over groups of
    `group` tokens: KIVI); values are always per token. `symmetric` applies to per-token rounding
    (per-channel is asymmetric). `window`: the tokens of a group not yet whole stay exact, as KIVI
    keeps its newest tokens; required for keys per channel, whose scales need the whole group.
    `bytes_per_token(num_layers, num_kv_heads, head_dim)`: what storing it would take, codes packed
    `bits` to a value, float32 scales (and minimums) as the pool keeps them; the window is not counted."""

    def __init__(self, bits: int = 4, keys: str = "token", symmetric: bool = True, window: bool = False,
                 group: int = 32):
        check_positive_int("bits", bits)
        check_positive_int("group", group)
        if keys not in ("token", "channel"):
            raise ValueError(f"keys must be 'token' or 'channel', got {keys!r}.")
        if keys == "channel" and not window:
            raise ValueError("Keys per channel need the whole group of tokens for their scales: give window=True "
                             "(the newest tokens, a group not yet whole, stay exact, as in KIVI).")
        self.bits, self.keys, self.symmetric, self.window, self.group = bits, keys, symmetric, window, group

    def __call__(self, k: torch.Tensor, v: torch.Tensor, cached: torch.Tensor,
                 layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, kv_heads, L, head_dim] of B sequences of `layer`, rounded (the same way in every
        layer). cached [B]: tokens each sequence had before this step; with `window`, only its whole
        groups among them are rounded, so no rounded token's scale depends on a later token."""
        k_round = (round_per_channel(k, self.bits, self.group) if self.keys == "channel"
                   else round_per_token(k, self.bits, self.symmetric))
        v_round = round_per_token(v, self.bits, self.symmetric)
        if not self.window:
            return k_round, v_round
        rounded = torch.arange(k.shape[2], device=k.device)[None, :] < (cached // self.group * self.group)[:, None]
        rounded = rounded[:, None, :, None]
        return torch.where(rounded, k_round, k.float()), torch.where(rounded, v_round, v.float())

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        codes = head_dim * self.bits / 8
        per_token = SCALE_BYTES * (1 if self.symmetric else 2)           # scale (and minimum) of a row
        per_channel = 2 * SCALE_BYTES * head_dim / self.group            # a channel's scale and minimum, per token
        k = codes + (per_channel if self.keys == "channel" else per_token)
        return math.ceil(num_layers * num_kv_heads * (k + codes + per_token))

    def __repr__(self) -> str:
        keys = f"keys per channel in groups of {self.group}" if self.keys == "channel" else "keys per token"
        kind = "asymmetric" if self.keys == "channel" or not self.symmetric else "symmetric"
        return f"Rounding(int{self.bits}, {keys}, values per token, {kind}{', window' if self.window else ''})"



class PerLayerScale:
    """A simulated fp8 e4m3 layout with one scale per layer for K and one for V, as vLLM's per-tensor
    `k_scale` and `v_scale`: x / s stored as e4m3 (saturating at +-448), s fixed beforehand.
    `scales` [layers, 2] (K, V): `calibrated_scales` (a calibration text's absmax / 448 per layer), or
    all 1.0 (what vLLM uses when a checkpoint brings none). `bytes_per_token`: the codes alone."""

    def __init__(self, scales: torch.Tensor):
        self.scales = scales.float()

    def __call__(self, k, v, cached, layer: int):
        return tuple((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
                     for x, s in zip((k, v), self.scales[layer].tolist(), strict=True))

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * num_kv_heads * head_dim


def calibrated_scales(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """[layers, 2]: the absmax of K and of V over `slots` of an "auto" pool (a calibration text's
    tokens), / 448, layer by layer."""
    return torch.stack([torch.stack([pool.k[layer][slots].abs().amax(), pool.v[layer][slots].abs().amax()])
                        for layer in range(pool.num_layers)]).float() / 448

def simulated_attention(rounding):
    """Chapter 5's paged attention (signature of `kvlearn.attention.paged_attention`) over an "auto"
    pool, with each sequence's gathered K and V passed through `rounding` (a `Rounding` or a
    `PerLayerScale`) before SDPA. With a window,
    give perplexity_and_kl chunk=rounding.group, so each step is one group and every query sees its
    own group exact (a larger chunk rounds groups that some of its queries saw before they were whole)."""
    def attention(query, key, value, layer, kv_pool, md, scale=None):
        kv_pool.write(layer, md.slot_mapping, key, value)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        k, v = (_context(c, md.kv_indices, query.dtype) for c in (kv_pool.k[layer], kv_pool.v[layer]))
        query_lens = torch.diff(md.last_token, prepend=md.last_token.new_tensor([-1]))
        k, v = rounding(k, v, md.kv_lens - query_lens, layer)
        q = query[md.query_index].transpose(1, 2)                             # [B, heads, Qmax, D]
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=md.mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, *query.shape[1:])[md.query_slots]
    attention.__qualname__ = f"simulated_attention({rounding!r})"
    return attention


def _context(cache, indices, dtype):
    """cache[indices] for [B, L] slot indices, as [B, kv_heads, L, head_dim] (an "auto" pool's rows)."""
    return cache.index_select(0, indices.reshape(-1)).to(dtype).view(*indices.shape, *cache.shape[1:]).transpose(1, 2)


# A fixed text to score the formats on (chapter 10): written for this course, so the model has not
# seen it, and frozen here, so the chapter's figures change only when the model or a format does.
HELD_OUT_TEXT = """\
The ferry to the island leaves twice a day, once at seven in the morning and once at four in the \
afternoon. In winter the afternoon crossing is often cancelled, because the wind turns around the \
headland and the harbour master will not let a small boat out into it. People who live on the island \
plan their weeks around those two departures. A doctor's appointment on the mainland means a night in \
a guest house; a broken window means a list, a phone call, and three days of cardboard.

The island has one shop, one school with eleven pupils, and a post office that opens on Tuesdays and \
Fridays. The shop keeps a notebook behind the counter. Anyone can write in it what they need from the \
mainland, and whoever takes the morning ferry buys what they can carry. Nobody remembers who started \
the notebook. The oldest pages are in pencil and list paraffin, rope, and seed potatoes; the newest ask \
for printer ink, a bicycle chain, and a charger for a particular kind of phone.

Summer is different. From June to September the ferry runs six times a day and the population triples. \
Visitors come for the cliffs, the birds, and the long beach on the western side, where the sand is pale \
and the water is colder than anyone expects. The shop stocks sun cream and postcards, the school \
becomes a café, and the harbour fills with yachts whose owners ask, politely and repeatedly, where they \
can buy fresh bread. The answer is nowhere, unless you know whose kitchen to knock at.

The islanders are patient with all of this. They know the visitors pay for the new pier and the \
doctor's monthly visit, and that in October the crowds will leave as suddenly as they came. Then the \
evenings grow dark early, the notebook fills up again, and the ferry's horn at four o'clock becomes the \
sound that tells everyone the day is nearly over.

A teacher who moved to the island last year said that the hardest thing to learn was not the weather \
or the quiet, but the timing. On the mainland, she said, you can always fix a mistake tomorrow. Here \
you fix it when the boat comes, and the boat comes when the sea allows. She now keeps a spare of \
everything: two kettles, two torches, a second pair of boots by the door. Her pupils find this very \
funny. Their parents do exactly the same."""
