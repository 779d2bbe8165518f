"""The conformance suite of the `attention` part (chapter 5), judged by attention one query at a time.

A program is a small pool (1-3 layers, 1-3 KV heads shared by 1-3 query heads each, random K and V
in every slot) and a few packed steps. A step is random metadata (`AttentionMetadata.build` over
1-3 sequences with 1-4 new tokens each after 0-7 cached ones, some sharing a cached prefix, every
slot drawn at random from the pool) and, like a forward of the model, one call per layer with
random query, key and value. After each call the pool must hold what the reference pool holds (the
step's K and V written slot by slot, nothing else changed) and the output must be the reference's
(`attention_reference` below), both within `RTOL` and `ATOL` (`torch.allclose`).
When the output is wrong, the hint names the rule it breaks (`_diagnose`).
"""

from __future__ import annotations

import random

import torch

from kvlearn.attention import AttentionMetadata
from kvlearn.parts.attention import AttentionPart
from kvlearn.parts.judge import Broken, Trace
from kvlearn.pool import KVPool

CONTRACT = AttentionPart

RTOL, ATOL = 1e-4, 1e-5   # float32 attention against the float64 reference

HINTS = {
    "contract": "attention(query, key, value, layer, kv_pool, md, scale) writes the step's K and V into the "
                "pool at md.slot_mapping, reads each sequence's context through its slots, and returns "
                "[tokens, heads, head_dim] (help(kvlearn.parts.AttentionPart)).",
    "write": "write the step's K and V first: kv_pool.write(layer, md.slot_mapping, key, value); the next "
             "step reads them from the pool, not from your arguments.",
    "layer": "write only the step's new slots of the layer you were called for: the pool holds every layer "
             "(kv_pool.k[layer] is one) and every other slot holds some sequence's K and V.",
    "shape": "return one output row per new token, in the packed order of query: [tokens, heads, head_dim].",
    "causal": "a new token sees its own position and everything before it in its own sequence, never a later "
              "token nor the padding: new token i of a sequence sits at position kv_len - query_len + i "
              "(md.mask holds exactly this).",
    "gqa": "query head h reads KV head h // (heads // kv_heads): consecutive query heads share a KV head "
           "(repeat_interleave, or scaled_dot_product_attention(..., enable_gqa=True)), not h % kv_heads.",
    "scale": "scores are q . k times the scale you are given; only scale=None means head_dim ** -0.5.",
    "order": "write before you read: a new token's own K and V (and those of the earlier new tokens of its "
             "sequence) are part of its context.",
    "output": "per sequence: gather its context's K and V from the pool through md.kv_indices[b, :md.kv_lens[b]], "
              "scores q . k * scale, the causal mask, softmax, weights times V.",
}


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    setup = {"num_layers": rng.randint(1, 3), "num_kv_heads": rng.randint(1, 3), "group": rng.randint(1, 3),
             "head_dim": rng.choice([2, 4, 8]), "num_slots": rng.randint(32, 48), "seed": rng.randrange(1 << 16)}
    ops = []
    for _ in range(rng.randint(1, 3)):   # "seq" ops join the next "step": shrinking drops sequences too
        ops += [("seq", rng.randrange(1 << 16)) for _ in range(rng.randint(1, 3))] + [("step", rng.randrange(1 << 16))]
    return setup, ops


def step_shape(rng: random.Random, seeds: list[int], num_slots: int) -> tuple[list[int], list[list[int]]]:
    """Query lengths and context slots of one step, a sequence per seed: 1-4 new tokens in fresh
    slots after 0-4 cached tokens of its own, maybe after a cached prefix shared by the step."""
    order = rng.sample(range(num_slots), num_slots)

    def take(n: int) -> list[int]:
        return [order.pop() for _ in range(n)]

    shared = take(rng.randint(1, 3)) if rng.random() < 0.4 else []
    query_lens, contexts = [], []
    for seed in seeds:
        own = random.Random(seed)
        prefix = shared[:own.randint(0, len(shared))] + take(own.randint(0, 4))
        query_lens.append(own.randint(1, 4))
        contexts.append(prefix + take(query_lens[-1]))
    return query_lens, contexts


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    # Tensors this small run fastest on one thread (more threads only wait for each other).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_program(impl, setup, ops, trace)
    finally:
        torch.set_num_threads(threads)


def run_program(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    layers, kv_heads, dim = setup["num_layers"], setup["num_kv_heads"], setup["head_dim"]
    heads = kv_heads * setup["group"]
    pool = KVPool(layers, kv_heads, dim, setup["num_slots"], device="cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(setup["seed"])))
    reference = pool.kv.clone()
    trace.note(f"pool = KVPool(num_layers={layers}, num_kv_heads={kv_heads}, head_dim={dim}, "
               f"num_slots={setup['num_slots']})   # random K and V in every slot")
    name = getattr(impl, "__name__", "attention")
    pending: list[int] = []
    for trace.op, (op, seed) in enumerate(ops):
        if op == "seq":
            pending.append(seed)
            continue
        if not pending:
            continue
        rng = random.Random(seed)
        query_lens, contexts = step_shape(rng, pending, setup["num_slots"])
        scale = rng.choice([None, 0.5, 0.25, 1.5])
        pending = []
        md = AttentionMetadata.build(query_lens, [torch.tensor(c) for c in contexts], device="cpu")
        tensors = ", ".join(f"torch.tensor({c})" for c in contexts)
        trace.note(f"md = AttentionMetadata.build({query_lens}, [{tensors}])")
        new_slots = [s for q, c in zip(query_lens, contexts, strict=True) for s in c[len(c) - q:]]
        tokens = len(new_slots)
        trace.note(f"# each layer: query = torch.randn({tokens}, {heads}, {dim}); key, value = "
                   f"torch.randn({tokens}, {kv_heads}, {dim}) twice")
        numbers = torch.Generator().manual_seed(seed)
        for layer in range(layers):
            query, key, value = (torch.randn(tokens, n, dim, generator=numbers) for n in (heads, kv_heads, kv_heads))
            before = reference[layer].clone()
            for t, slot in enumerate(new_slots):
                reference[layer, 0, slot], reference[layer, 1, slot] = key[t], value[t]
            out = trace.call(f"out = {name}(query, key, value, {layer}, pool, md, {scale})", impl,
                             query.clone(), key.clone(), value.clone(), layer, pool, md, scale)
            check_pool(pool, reference, layer, new_slots)
            check_output(out, query, reference[layer], before, query_lens, contexts,
                         dim ** -0.5 if scale is None else scale)


def check_pool(pool: KVPool, reference: torch.Tensor, layer: int, new_slots: list[int]) -> None:
    """The part's pool must hold the reference's K and V, every layer and slot (another layer
    changed is reported first: it explains a layer left unwritten)."""
    if torch.allclose(pool.kv, reference, rtol=RTOL, atol=ATOL):
        return
    differ = ~torch.isclose(pool.kv, reference, rtol=RTOL, atol=ATOL).flatten(3).all(-1)   # [layers, 2, slots]
    others = differ.clone()
    others[layer] = False
    where, kv, slot = (int(x) for x in (others if others.any() else differ).nonzero()[0])
    got, expected = pool.kv[where, kv, slot, 0, :3], reference[where, kv, slot, 0, :3]
    hint = HINTS["write"] if where == layer and slot in new_slots else HINTS["layer"]
    note = "" if slot in new_slots else f" (slot {slot} is not one of the step's new slots)"
    if where != layer:
        note = f" (layer {where}; the call was for layer {layer})"
    raise Broken(f"after the call, pool.{'kv'[kv]}[{where}][{slot}] (KV head 0, first numbers): expected "
                 f"{_short(expected)}, got {_short(got)}{note}", hint)


def check_output(out, query, rows: torch.Tensor, before: torch.Tensor, query_lens, contexts, scale: float) -> None:
    """The part's output must be the reference's attention, query by query."""
    shape = tuple(query.shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else f"{type(out).__name__}"
        raise Broken(f"out must be a tensor of shape {list(shape)} (tokens, heads, head_dim), got {got}",
                     HINTS["shape"])
    k_rows, v_rows = rows[0], rows[1]
    expected = attention_reference(query, k_rows, v_rows, query_lens, contexts, scale)
    got = out.detach().double()
    if torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
        return
    bad = ~torch.isclose(got, expected, rtol=RTOL, atol=ATOL).all(-1)   # [tokens, heads]
    t, h = (int(x) for x in bad.nonzero()[0])
    b = next(i for i in range(len(query_lens)) if t < sum(query_lens[:i + 1]))
    i = t - sum(query_lens[:b])
    position = len(contexts[b]) - query_lens[b] + i
    what = (f"out[{t}] (sequence {b}, new token {i} at position {position}), head {h}: expected "
            f"{_short(expected[t, h, :3])}, got {_short(got[t, h, :3])}")
    raise Broken(what, _diagnose(got, query, rows, before, query_lens, contexts, scale))


def _diagnose(got, query, rows, before, query_lens, contexts, scale) -> str:
    """The hint of the rule the output breaks, from the reference on other inputs: another scale,
    the pool before the write (read before write), query heads mapped h % kv_heads (permuted so that
    the reference's h // group reads that KV head); or from where it is wrong: right for each
    sequence's last new token (which sees its whole context) and wrong before it, the causal mask."""
    def matches(q=query, kv=rows, s=scale) -> bool:
        expected = attention_reference(q, kv[0], kv[1], query_lens, contexts, s)
        return torch.allclose(got, expected[:, order] if q is not query else expected, rtol=RTOL, atol=ATOL,
                              equal_nan=True)

    heads, kv_heads = query.shape[1], rows.shape[2]
    order = [(h % kv_heads) * (heads // kv_heads) + h // kv_heads for h in range(heads)]
    permuted = torch.empty_like(query)
    permuted[:, order] = query
    for hint, change in (("scale", dict(s=query.shape[-1] ** -0.5)), ("scale", dict(s=1.0)),
                         ("scale", dict(s=1 / scale)), ("order", dict(kv=before)), ("gqa", dict(q=permuted))):
        if matches(**change):
            return HINTS[hint]
    expected = attention_reference(query, rows[0], rows[1], query_lens, contexts, scale)
    last = [sum(query_lens[:b + 1]) - 1 for b in range(len(query_lens))]
    if torch.allclose(got[last], expected[last], rtol=RTOL, atol=ATOL):
        return HINTS["causal"]
    return HINTS["output"]


def _short(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in values.tolist()) + ", ...]"


def attention_reference(query, k_rows: dict, v_rows: dict, query_lens: list[int], contexts: list[list[int]],
                        scale: float):
    """Paged attention one query at a time, in float64. `k_rows[slot]`, `v_rows[slot]`: one layer's
    [kv_heads, head_dim] K and V at that slot (the new tokens' already written); `contexts[b]`: the
    slots of sequence b's whole context, its new tokens the last `query_lens[b]`. New token t of
    sequence b sits at position len(contexts[b]) - query_lens[b] + t and sees positions 0 .. that
    one; query head h reads KV head h // (heads // kv_heads). Returns [T, heads, head_dim] in packed order."""
    heads = query.shape[1]
    out, t = [], 0
    for q_len, context in zip(query_lens, contexts, strict=True):
        for i in range(q_len):
            seen = context[:len(context) - q_len + i + 1]
            k = torch.stack([k_rows[s] for s in seen]).double()        # [keys, kv_heads, head_dim]
            v = torch.stack([v_rows[s] for s in seen]).double()
            kv_of = [h // (heads // k.shape[1]) for h in range(heads)]
            k, v = k[:, kv_of], v[:, kv_of]                              # [keys, heads, head_dim]
            weights = torch.softmax(torch.einsum("hd,khd->hk", query[t].double(), k) * scale, dim=-1)
            out.append(torch.einsum("hk,khd->hd", weights, v))
            t += 1
    return torch.stack(out)
