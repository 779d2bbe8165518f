"""The conformance suite of the `decode_kernel` part (chapter 5): a stage-1 kernel, launched in Triton's
interpreter by `paged_decode_attention(..., stage1=kernel)`, judged by attention one query at a time.

A program is one decode step of 1-4 sequences: GQA groups 1, 3 or 4 over 1-2 KV heads, head_dim 64
or 128, a float32 or bfloat16 pool of pages of 1 or 16 slots in shuffled order, contexts at the tile
edges (1, 63, 64, 65 positions) or of a few tiles, in 1-3 splits (more splits than positions leaves
some empty). The pool is poisoned: slots that no table reaches hold NaN, and the slots a table
reaches at or past its sequence's kv_len hold K 0 and V 1e6, so a read outside the mask shows. A
wrong output's hint comes from the kernel run again on changed inputs, never from wrong variants of
the reference: NaN that goes once the NaN slots hold 0 was read there; a huge value that goes once
the past slots hold 0 was weighed past kv_len; with V = its KV head's number + 1, every output of a
head must be that number; then one split, all scores equal (K = 0), and only the first tile.
"""

from __future__ import annotations

import random
from functools import partial

import torch

from kvlearn.parts.decode_kernel import DecodeKernelPart
from kvlearn.parts.judge import Broken, Trace
from kvlearn.parts.references import attention_reference

CONTRACT = DecodeKernelPart
PROGRAMS, TIME_LIMIT_S = 24, 30.0   # a call is a whole interpreted launch: slow, and few are needed
CONTEXTS = (1, 63, 64, 65, 100, 129, 200)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
JUDGE = "attention one query at a time, in float64, over a poisoned pool"

HINTS = {
    "paged_decode_attention": "the kernel must run in Triton's interpreter: read the error above; tl.load and "
                              "tl.dot need tiles of matching shapes ([BLOCK_N] positions, [BLOCK_N, BLOCK_D] K and V).",
    "slot": "the slot formula: position pos lives at slot table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, "
            "its K and V at [slot, g, :]; load only the tile's real positions (mask=ok). A NaN slot was read.",
    "past": "a position at or past kv_len was weighed: the last tile runs past the split's end, so ok = pos < end "
            "masks its loads and sets its scores to -inf (tl.where(ok[None, :], score, float('-inf'))).",
    "nan": "NaN or inf from the online softmax's arithmetic, not from a read: m starts at -inf, so the first tile's "
           "alpha = exp(m - m_new) is 0; multiply by it, never divide (l * alpha, acc * alpha[:, None]).",
    "gqa": "which KV head a query head reads: program (b, g, s) serves the query heads g * GROUP .. g * GROUP + "
           "GROUP - 1, and all of them read KV head g (k_cache[slot, g, :]).",
    "weights": "the weights of one query must sum to 1: l sums exp(score - m_new) over exactly the positions acc "
               "weighs (a position that ok masks has score -inf), both rescaled alike by alpha, and the output is "
               "acc / l (with V = 1 everywhere it is 1).",
    "split": "a split's log-sum-exp: it is right with one split and wrong with several. Each split covers its own "
             "positions start .. end - 1 and leaves m and l such that m + log(l) is the log of its sum of exp(score).",
    "range": "each position once: the tile's positions are n + tl.arange(0, BLOCK_N), n from the split's start "
             "(with all scores equal the output must be the mean of V over the context, and it is not).",
    "rescale": "the running sum and the accumulator were not rescaled by exp(m_old - m_new) when the max grew: "
               "right for a context of one tile, wrong for longer ones.",
    "score": "scores are q . k * scale (tl.dot(q, tl.trans(k)) * scale) and weights p = exp(score - m_new[:, None]), "
             "m_new the running max including this tile.",
}


def unmet() -> str | None:
    """Why the suite cannot run here (Triton does not import, or cannot launch on this device), or None."""
    from kvlearn.kernels import triton_import_error

    why = triton_import_error()
    if why is not None:
        return f"the kernel is Triton code, and triton does not import here ({why}): Triton ships wheels for Linux."
    from kvlearn.kernels.common import check_launch

    try:
        check_launch(_device())
    except ValueError as error:
        return str(error)
    return None


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"group": rng.choice([1, 3, 4]), "kv_heads": rng.choice([1, 2]), "head_dim": rng.choice([64, 128]),
             "dtype": rng.choice([torch.float32, torch.float32, torch.bfloat16]), "page_size": rng.choice([1, 16]),
             "splits": rng.choice([1, 2, 3]), "lens": [rng.choice(CONTEXTS) for _ in range(rng.randint(1, 4))],
             "scale": rng.choice([1.0, 2.0]), "seed": rng.randrange(1 << 16)}
    return setup, [("step", setup["seed"])]   # one launch: nothing to shrink


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    ps, kv_heads, dim, dtype, lens = (setup[k] for k in ("page_size", "kv_heads", "head_dim", "dtype", "lens"))
    gen, heads = torch.Generator().manual_seed(setup["seed"]), kv_heads * setup["group"]
    needed = [-(-n // ps) for n in lens]
    pages = torch.randperm(2 * sum(needed) + 5, generator=gen).tolist()   # shuffled: past page, sequences', unreached
    past_page, unreached = pages[0], pages[1 + sum(needed):]
    width = -(-(max(lens) + 64) // ps)   # a whole tile past kv_len stays in the row
    table = torch.full((len(lens) + 2, width), unreached[0])   # rows 0 and B + 1: padding, NaN pages
    table[1:-1] = past_page
    for b, n in enumerate(needed):
        table[b + 1, :n] = torch.tensor(pages[1 + sum(needed[:b]):1 + sum(needed[:b + 1])])
    table = table[1:-1]
    contexts = [[int(table[b, p // ps]) * ps + p % ps for p in range(n)] for b, n in enumerate(lens)]
    shape = (len(pages) * ps, kv_heads, dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    past = torch.zeros(shape[0], dtype=torch.bool)
    past[past_page * ps:(past_page + 1) * ps] = True
    for b, n in enumerate(lens):
        past[contexts[b][-1] + 1:(table[b, needed[b] - 1] + 1) * ps] = True   # the rest of the last page
    for page in unreached:
        k[page * ps:(page + 1) * ps] = v[page * ps:(page + 1) * ps] = float("nan")
    k[past], v[past] = 0.0, 1e6
    device = _device()
    k, v, table = k.to(device, dtype), v.to(device, dtype), table.to(device)
    query = torch.randn(len(lens), heads, dim, generator=gen).to(device, dtype)
    kv_lens, scale = torch.tensor(lens, device=device), setup["scale"] * dim ** -0.5
    trace.note(f"# {shape[0] // ps} pages of {ps} slot(s) in shuffled order, {str(dtype)[6:]}; {kv_heads} KV "
               f"head(s) of head_dim {dim}, {heads} query heads; slots no table reaches hold NaN, those past "
               "kv_len K 0 and V 1e6")
    trace.note(f"kv_lens = {lens}; table = the pages of each sequence (table[b, :{needed}[b]]), then the past page")

    one = torch.full((len(lens), max(lens) + 64), past_page * ps, device=device)   # the same slots, pages of 1
    for b, c in enumerate(contexts):
        one[b, :len(c)] = torch.tensor(c)

    def launch(kk=k, vv=v, lengths=kv_lens, splits=setup["splits"], layout=(table, ps), quiet=True):
        line = (f"out = paged_decode_attention(query, k_cache, v_cache, table, kv_lens={lengths.tolist()}, "
                f"scale={scale:.4g}, page_size={layout[1]}, num_splits={splits}, stage1={getattr(impl, '__name__', impl)})")
        return trace.call(line, paged_decode_attention(), query, kk, vv, layout[0], lengths, scale, layout[1], splits,
                          stage1=impl, quiet=quiet).double().cpu()

    def right(out, kk=k, vv=v, lengths=lens) -> bool:
        rows = [c[:n] for c, n in zip(contexts, lengths)]
        want = attention_reference(query.cpu(), kk.cpu(), vv.cpu(), [1] * len(lens), rows, scale)
        return torch.allclose(out, want, *TOLERANCE[dtype])

    got = launch(quiet=False)
    if right(got):
        return
    want = attention_reference(query.cpu(), k.cpu(), v.cpu(), [1] * len(lens), contexts, scale)
    b, h = (int(x) for x in (~torch.isclose(got, want, *TOLERANCE[dtype])).any(-1).nonzero()[0])
    raise Broken(f"out[{b}, {h}] (sequence {b}, kv_len {lens[b]}, query head {h}; first numbers): expected "
                 f"{_short(want[b, h])}, got {_short(got[b, h])}",
                 HINTS[_diagnose(got, partial(launch, layout=(one, 1)), right, setup, k, v, past, contexts)])


def _diagnose(got, launch, right, setup, k, v, past, contexts) -> str:
    """The rule a wrong output breaks, from the kernel's outputs on changed inputs (see the module);
    `launch` runs it with pages of one slot (a read outside that is right then: the page arithmetic)."""
    if not got.isfinite().all() or (got.abs() > 1e4).any():
        if setup["page_size"] > 1 and right(got := launch()):
            return "slot"
    nan, huge = got.isnan().any(), (got.abs() > 1e4).any()
    if nan and not launch(kk=k.nan_to_num(0.0), vv=v.nan_to_num(0.0)).isnan().any():
        return "slot"
    if huge and not (launch(vv=v.masked_fill(past[:, None, None].to(v.device), 0.0)).abs() > 1e4).any():
        return "past"
    if nan or huge or not got.isfinite().all():
        return "nan"
    number = v.clone()
    slots = torch.tensor([s for c in contexts for s in c], device=v.device)
    number[slots] = (torch.arange(v.shape[1], device=v.device) + 1.0)[None, :, None].to(v.dtype)
    by_head = launch(vv=number, splits=1)
    expected = (torch.arange(by_head.shape[1]) // setup["group"] + 1.0)[None, :, None].expand_as(by_head).double()
    if not torch.allclose(by_head, expected, rtol=1e-3):
        whole = torch.allclose(by_head, by_head.round(), atol=1e-3) and by_head.round().min() >= 1
        return "gqa" if whole and by_head.max() <= v.shape[1] else "weights"
    if setup["splits"] > 1 and right(launch(splits=1)):
        return "split"
    if not right(launch(kk=torch.zeros_like(k), splits=1), kk=torch.zeros_like(k)):
        return "range"
    first = [min(n, 64) for n in setup["lens"]]
    return "rescale" if right(launch(lengths=torch.tensor(first, device=k.device), splits=1), lengths=first) else "score"


def paged_decode_attention():
    """The launcher (imported when first run: importing kvlearn.parts never imports triton)."""
    from kvlearn.kernels.decode import paged_decode_attention as launcher

    return launcher


def _short(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in values[:3].tolist()) + ", ...]"
