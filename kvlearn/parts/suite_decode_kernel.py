"""The conformance suite of the `decode_kernel` part (chapter 5): a stage-1 kernel launched in Triton's
interpreter by `paged_decode_attention(..., stage1=kernel)`, judged by attention one query at a time.

A program is one decode step: 1-4 sequences at the tile edges (1, 63, 64, 65 positions) or of a few
tiles, in 1-3 splits (some empty), GQA groups 1, 3 or 4 over 1-3 KV heads, head_dim 64, 80 or 128, a
float32 or bfloat16 pool of shuffled pages of 1, 6 or 16 slots, poisoned: slots no table reaches hold
NaN, slots a table reaches at or past kv_len K 0 and V 1e8. An access outside the rules of
`kvlearn.kernels.decode_rules` (outside the pool, another table row, an unmasked table load) is stopped
before it is made and named. A wrong output's hint comes from the kernel run again on changed inputs
(`_diagnose`), never from wrong variants of the reference.
"""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import torch

from kvlearn.kernels.watch import AddressError
from kvlearn.parts.decode_kernel import DecodeKernelPart
from kvlearn.parts.judge import Broken, Raised, Trace
from kvlearn.parts.suite_attention import attention_reference

CONTRACT = DecodeKernelPart
PROGRAMS, TIME_LIMIT_S = 24, 30.0   # a call is a whole interpreted launch: slow, and few are needed
CONTEXTS = (1, 63, 64, 65, 100, 129, 200)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
JUDGE = "attention one query at a time, in float64, over a poisoned pool"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

HINTS = {
    "paged_decode_attention": "the kernel must run in Triton's interpreter: read the error above.",
    "slot": "the slot formula: position pos lives at slot table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, "
            "its K and V at [slot, g, :]; load only the tile's real positions (mask=ok).",
    "past": "a position at or past kv_len was weighed: the last tile runs past the split's end, so ok = pos < end "
            "masks its loads and sets its scores to -inf (tl.where(ok[None, :], score, float('-inf'))).",
    "nan": "NaN, inf or huge values from arithmetic, not a read (NaN everywhere: is the tile loop written? each tile "
           "adds to l and acc). m starts at -inf, so the first tile's alpha = exp(m - m_new) is 0: multiply by it, "
           "never divide (l * alpha, acc * alpha[:, None]).",
    "gqa": "which KV head a query head reads: program (b, g, s) serves the query heads g * GROUP .. g * GROUP + "
           "GROUP - 1, and all of them read KV head g (k_cache[slot, g, :]).",
    "weights": "the weights of one query sum to 1: l sums exp(score - m_new) over the positions acc weighs (one "
               "that ok masks has score -inf), both rescaled alike by alpha (with V = 1 the output is 1).",
    "split": "a split's log-sum-exp: right with one split, wrong with several. A split covers positions start .. "
             "end - 1 and ends with m + log(l) = the log of its sum of exp(score).",
    "table row": "row b of the table starts at table + b * stride_tb: a program reads its own sequence's row, "
                 "never another's.",
    "table index": "the table holds one entry per page, not per position: position pos's page is entry "
                   "pos // PAGE_SIZE of row b (table + b * stride_tb + pos // PAGE_SIZE).",
    "table mask": "load the table with mask=ok (and other=0): an unmasked load reads the entries of the whole tile, "
                  "past the split's end, and past the row on the last tile: on a GPU, another tensor's memory.",
    "outside": "an address is a tensor's pointer plus an offset from this program's own indices and the strides the "
               "launcher passes: K and V of a slot at k_cache + slot * stride_cs + g * stride_ch + d, the slot "
               "table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, the query at query + b * stride_qt + "
               "head * stride_qh + d.",
    "store": "stage 1 writes only its own results: acc / l into part_out and m + log(l) into part_lse.",
    "range": "each position once, from its own row: the tile's positions are n + tl.arange(0, BLOCK_N), their K and V "
             "at slot[:, None] * stride_cs + g * stride_ch + d[None, :] (with equal scores the output is V's mean).",
    "rescale": "the running sum and the accumulator were not rescaled by exp(m_old - m_new) when the max grew: "
               "right for a context of one tile, wrong for longer ones.",
    "score": "scores are tl.dot(q, tl.trans(k)) * scale and weights p = exp(score - m_new[:, None]), m_new the "
             "running max including this tile.",
}


def unmet() -> str | None:
    """Why the suite cannot run here (Triton does not import, or cannot launch on this device), or None."""
    from kvlearn.kernels import resolve_attention_backend

    try:
        resolve_attention_backend("triton", DEVICE)
    except ValueError as error:
        return str(error)


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"group": rng.choice([1, 3, 4]), "kv_heads": rng.choice([1, 2, 3]), "head_dim": rng.choice([64, 80, 128]),
             "dtype": rng.choice([torch.float32, torch.float32, torch.bfloat16]), "page_size": rng.choice([1, 6, 16]),
             "splits": rng.choice([1, 2, 3]), "lens": [rng.choice(CONTEXTS) for _ in range(rng.randint(1, 4))],
             "scale": rng.choice([1.0, 2.0]), "seed": rng.randrange(1 << 16)}
    return setup, [("step", setup["seed"])]   # one launch: nothing to shrink (the hint reruns it enough)


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    from kvlearn.kernels.decode import paged_decode_attention  # here: importing kvlearn.parts imports no triton
    ps, kv_heads, dim, dtype, lens = (setup[k] for k in ("page_size", "kv_heads", "head_dim", "dtype", "lens"))
    gen, heads = torch.Generator().manual_seed(setup["seed"]), kv_heads * setup["group"]
    needed = [-(-n // ps) for n in lens]
    pages = torch.randperm(2 * sum(needed) + 5, generator=gen)   # shuffled: the past page, sequences', unreached
    table = torch.full((len(lens) + 2, -(-(max(lens) + 64) // ps)), int(pages[-1]))   # rows 0, B + 1: padding
    table[1:-1] = pages[0]   # a whole tile past kv_len stays in the row, on the past page
    for b, own in enumerate(pages[1:1 + sum(needed)].split(needed)):
        table[b + 1, :len(own)] = own
    table = table[1:-1]
    contexts = [[int(table[b, p // ps]) * ps + p % ps for p in range(n)] for b, n in enumerate(lens)]
    k, v = (torch.randn(len(pages), ps, kv_heads, dim, generator=gen) for _ in "kv")
    k[pages[1 + sum(needed):]] = v[pages[1 + sum(needed):]] = float("nan")
    past = torch.zeros(len(pages), ps, dtype=torch.bool)
    past[pages[0]] = True
    for b, n in enumerate(lens):
        past[table[b, needed[b] - 1], (n - 1) % ps + 1:] = True   # the rest of the last page
    k[past], v[past] = 0.0, 1e8
    (k, v), past, shape = (x.flatten(0, 1) for x in (k, v)), past.flatten(), (len(pages) * ps, kv_heads, dim)
    k, v, table = k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE)
    query = torch.randn(len(lens), heads, dim, generator=gen).to(DEVICE, dtype)
    kv_lens, scale, name = torch.tensor(lens, device=DEVICE), setup["scale"] / dim**0.5, getattr(impl, "__name__", "?")
    trace.note(f"# {shape[0] // ps} shuffled pages of {ps} slot(s), {str(dtype)[6:]}, {kv_heads} KV head(s), head_dim "
               f"{dim}, {heads} query heads; NaN where no table reaches, K 0 and V 1e8 at or past kv_len {lens}")
    one = torch.full((len(lens), max(lens) + 64), int(pages[0]) * ps, device=DEVICE)   # the same slots, pages of 1
    for b, c in enumerate(contexts):
        one[b, :len(c)] = torch.tensor(c)

    def launch(kk=k, vv=v, lengths=kv_lens, splits=setup["splits"], layout=(table, ps), quiet=True):
        line = (f"out = paged_decode_attention(query, k_cache, v_cache, table, kv_lens={lengths.tolist()}, "
                f"scale={scale:.4g}, page_size={layout[1]}, num_splits={splits}, stage1={name})")
        try:   # numpy's warnings of NaN in the interpreter's arithmetic stay quiet: the output is judged
            with np.errstate(all="ignore"):
                out = trace.call(line, paged_decode_attention, query, kk, vv, layout[0], lengths, scale, layout[1],
                                 splits, stage1=impl, quiet=quiet)
        except Raised as raised:   # an access the rules forbid, stopped before it was made
            if isinstance(raised.error, AddressError):
                raise Broken(str(raised.error), HINTS[raised.error.rule]) from None
            raise
        return out.double().cpu()

    def right(out, kk=k, vv=v, lengths=lens) -> bool:
        rows = [c[:n] for c, n in zip(contexts, lengths, strict=True)]
        want = attention_reference(query.cpu(), kk.cpu(), vv.cpu(), [1] * len(lens), rows, scale)
        return torch.allclose(out, want, *TOLERANCE[dtype])

    got = launch(quiet=False)
    if right(got):
        return
    want = attention_reference(query.cpu(), k.cpu(), v.cpu(), [1] * len(lens), contexts, scale)
    b, h = (int(x) for x in (~torch.isclose(got, want, *TOLERANCE[dtype])).any(-1).nonzero()[0])
    raise Broken(f"out[{b}, {h}] (sequence {b}, kv_len {lens[b]}, query head {h}; first numbers): expected "
                 f"{want[b, h, :3].round(decimals=4).tolist()}, got {got[b, h, :3].round(decimals=4).tolist()}",
                 HINTS[_diagnose(got, partial(launch, layout=(one, 1)), right, setup, k, v, past, contexts)])


def _diagnose(got, launch, right, setup, k, v, past, contexts) -> str:
    """The rule a wrong output breaks, from the kernel's outputs on changed inputs, with pages of one slot
    (`launch`). All scores equal (K = 0) and V = its KV head's number + 1 in every slot, beside a padding
    head of -1000: a wrong whole number is another KV head. Right with pages of one: the page arithmetic;
    NaN that goes once the NaN slots hold 0 was read there; huge values that go once the past slots hold 0
    were weighed past kv_len. Then V = the head's number in the context only: less, with K = 0, is weight
    on the masked positions (their V loads 0); another number, with the real K, is weights that do not
    sum to 1. Then one split, all scores equal, only the first tile."""
    expected = (torch.arange(got.shape[1]) // setup["group"] + 1.0)[None, :, None].expand_as(got).double()
    padded = torch.full((v.shape[0], v.shape[1] + 1, v.shape[2]), -1e3, dtype=v.dtype, device=DEVICE)
    padded[:, :-1] = (torch.arange(v.shape[1], device=DEVICE) + 1.0)[None, :, None]
    by_head = launch(kk=torch.zeros_like(padded)[:, :-1], vv=padded[:, :-1], splits=1)
    if torch.allclose(by_head, by_head.round(), atol=1e-3) and not torch.allclose(by_head, expected, rtol=1e-3):
        return "gqa"   # whole numbers, the wrong ones: the right positions, another KV head's K and V
    if setup["page_size"] > 1 and right(got := launch()):
        return "slot"
    nan, huge = got.isnan().any(), (got.abs() > 100).any()
    if nan and not launch(kk=k.nan_to_num(0.0), vv=v.nan_to_num(0.0)).isnan().any():
        return "slot"
    if huge and not (launch(vv=v.masked_fill(past[:, None, None].to(v.device), 0.0)).abs() > 100).any():
        return "past"
    if nan or huge or not got.isfinite().all():
        return "nan"
    number, slots = v.clone(), torch.tensor([s for c in contexts for s in c], device=DEVICE)
    number[slots] = (torch.arange(v.shape[1], device=DEVICE) + 1.0)[None, :, None].to(v.dtype)
    flat = launch(kk=torch.zeros_like(k), vv=number, splits=1)
    if (flat > 0).all() and (flat < expected + 1e-3).all() and (flat < expected - 1e-3).any():
        return "past"   # equal scores, outputs below their numbers: weight on masked positions, whose V is 0
    if not torch.allclose(launch(vv=number, splits=1), expected, rtol=1e-3):
        return "weights"   # the right KV head (above), yet not the mean of its V: the weights do not sum to 1
    if setup["splits"] > 1 and right(launch(splits=1)):
        return "split"
    if not right(launch(kk=torch.zeros_like(k), splits=1), kk=torch.zeros_like(k)):
        return "range"
    first = [min(n, 64) for n in setup["lens"]]   # one tile each
    return "rescale" if right(launch(lengths=torch.tensor(first, device=DEVICE), splits=1), lengths=first) else "score"
