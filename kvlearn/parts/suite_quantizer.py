"""The conformance suite of the `quantizer` part (chapter 10), judged row by row in float64.

Batches x [tokens, kv_heads, head_dim], float32 or bfloat16, of rows drawn apart (random values of size 1e-3
to 1e37; zeros; ties, x / scale = k + 0.5; tiny float32 values, x / scale past 127), each judged by
`int8_row` below, with no NaN made along the way (`NaNWatch`: 0 / 0 on a zero row, which int8 hides as
0 on a CPU); then some tokens again (the same bytes) and `dequantize` (codes * scale in float32, then
its dtype, to the bit)."""

import random
import struct

import torch
from torch.overrides import TorchFunctionMode

from kvlearn.parts.judge import Broken, Trace, shown
from kvlearn.parts.quantizer import QuantizerPart

CONTRACT = QuantizerPart
DTYPES, KINDS = (torch.float32, torch.bfloat16), ("random", "zero", "tie", "tiny")   # tiny: float32 only
HINTS = {
    "quantize": "quantize(x) takes rows x [..., head_dim], float32 or bfloat16, and computes in float32 (x.float()).",
    "codes": "quantize(x) returns (codes, scale) on x's device; codes are int8 (.to(torch.int8)), one per value of x.",
    "scale_shape": "scale is float32 of shape [..., 1], one per row: amax(-1, keepdim=True) keeps the last dimension.",
    "per_row": "a row's scale is its own absmax / 127, in float32: x.float().abs().amax(-1, keepdim=True) / 127.",
    "round": "codes are round(x / scale), the nearest integer (ties to even, as torch.round), not x / scale truncated.",
    "clamp": "codes stay in [-127, 127]: the float32 scale is rounded, so x / scale can pass 127; clamp, then .to().",
    "zero": "an all-zero row has scale 0 and codes 0: divide by 1 where the scale is 0, never 0 / 0 (NaN).",
    "local": "a row's codes and scale depend on that row alone, whatever else is in the batch.",
    "input": "quantize does not change x: no in-place operation on it (x.div_, x[...] = ...).",
    "dequantize": "dequantize(codes, scale, dtype) is codes * scale computed in float32: codes.float() * scale.",
    "dtype": "dequantize returns the codes' shape in the dtype it is given: (codes.float() * scale).to(dtype).",
}


def generate(rng: random.Random) -> tuple[dict, list[int]]:
    return {"head_dim": rng.choice([4, 8, 16, 64])}, [rng.randrange(1 << 30) for _ in range(rng.randint(1, 4))]


def draw_row(r: random.Random, n: int, kind: str) -> list[float]:   # tiny: multiples of float32's least, 2^-149
    if kind in ("zero", "random"):
        size = r.choice([1e-3, 1.0, 40.0, 1e37]) if kind == "random" else 0.0
        return [max(-4.0, min(4.0, r.gauss(0, 1))) * size * r.choice([1, -1]) for _ in range(n)]
    step, top = (2.0 ** r.randint(-8, 4), 127) if kind == "tie" else (2.0 ** -149, r.randint(64, 16000))
    row = [(r.randint(-top, top - 1) + (kind == "tie" and r.random() < 0.7) / 2) * step for _ in range(n)]
    row[r.randrange(n)] = r.choice([-top, top]) * step   # the row's absmax
    return row


def answer_problem(x: torch.Tensor, got) -> tuple[str, str] | None:
    """(what is wrong, its rule) with the types and shapes of `got`, quantize(x)'s answer; None: nothing."""
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return f"quantize(x) returned {type(got).__name__}, not (codes, scale)", "codes"
    for t, dtype, shape, rule in ((got[0], torch.int8, x.shape, "codes"),
                                  (got[1], torch.float32, x.shape[:-1] + (1,), "scale_shape")):
        if t.dtype != dtype or t.shape != shape or t.device != x.device:
            return f"{rule[:5]}: {t.dtype} {list(t.shape)} on {t.device}, x: {x.dtype} {list(x.shape)}", rule
    return None


def run(impl, setup: dict, ops: list[int], trace: Trace) -> None:
    quantizer = trace.call(f"quantizer = {impl.__name__}({setup['head_dim']})", impl, n := setup["head_dim"])
    for trace.op, seed in enumerate(ops):
        r = random.Random(seed)
        dtype, want, tokens, heads = r.choice(DTYPES), r.choice(DTYPES), r.randint(1, 4), r.randint(1, 3)
        kinds = [[r.choice(KINDS[:3 + (dtype == torch.float32)]) for _ in range(heads)] for _ in range(tokens)]
        x = torch.tensor([[draw_row(r, n, k) for k in ks] for ks in kinds], dtype=torch.float64).to(dtype)
        trace.note(f"x = ...   # {dtype} [{tokens}, {heads}, {n}], rows x[t, h] of kinds {kinds}")
        with NaNWatch() as watch:   # a NaN in the arithmetic may vanish from the codes: int8(NaN) is 0 on a CPU
            before, got = x.clone(), trace.call("codes, scale = quantizer.quantize(x)", quantizer.quantize, x)
        if problem := ("quantize changed x", "input") if not torch.equal(x, before) else answer_problem(x, got):
            raise Broken(problem[0], HINTS[problem[1]])
        if watch.made:
            raise Broken(f"quantize made NaN from numbers that held none, in {watch.made} (a row of zeros: "
                         "0 / 0); its codes may look right here, as int8(NaN) is 0 on this CPU, not on a GPU",
                         HINTS["zero"])
        for i, (row, codes, (scale,)) in enumerate(zip(*(t.flatten(0, 1).tolist() for t in (x.double(), *got)),
                                                       strict=True)):
            (expected, quotients), where = int8_row(row), f"x[{i // heads}, {i % heads}] (first values {row[:4]})"
            if not abs(scale - expected) <= expected * 2 ** -21:   # NaN is never close
                raise Broken(f"{where}: expected scale {expected!r} (absmax / 127), got {scale!r}",
                             HINTS["zero" if not expected and scale != scale else "per_row"])
            wrong = [j for j, (q, c) in enumerate(zip(quotients, codes, strict=True))
                     if c != round(q) and (q % 1 == 0.5 or abs(c - q) > 0.5 + 1e-4)]   # a tie goes to the even one
            if wrong:
                j, q = wrong[0], quotients[wrong[0]]
                raise Broken(f"{where}: x / scale at {j} is {row[j] / (expected or 1)!r}, so code {round(q)}, not "
                             f"{codes[j]}", HINTS["zero" if not expected else "clamp" if abs(q) == 127 else "round"])
        some = sorted(r.sample(range(tokens), r.randint(1, tokens)))
        again = trace.call(f"quantizer.quantize(x[{some}])", quantizer.quantize, x[some])
        if answer_problem(x[some], again) or not all(map(torch.equal, again, (got[0][some], got[1][some]))):
            raise Broken(f"tokens {some} quantized alone got other codes or scales than in x", HINTS["local"])
        out = trace.call(f"quantizer.dequantize(codes, scale, {want})", quantizer.dequantize, *got, want)
        if not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == want):
            raise Broken(f"dequantize(codes, scale, {want}) returned {shown(out)}", HINTS["dtype"])
        exact = (got[0].float() * got[1]).to(want)   # float32, then the dtype: another order rounds differently
        far = (out != exact).nonzero().tolist()
        if far:
            raise Broken(f"dequantize at {far[0]}: codes * scale in float32, then {want}, is "
                         f"{exact[tuple(far[0])].item()!r}, got {out[tuple(far[0])].item()!r}", HINTS["dequantize"])


class NaNWatch(TorchFunctionMode):
    """Within the block, `made` names the first torch operation whose result holds NaN while none of its
    tensor arguments did (None: none did)."""

    made = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.made is None and isinstance(out, torch.Tensor) and out.is_floating_point() and out.isnan().any():
            inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            if not any(a.is_floating_point() and a.isnan().any() for a in inputs):
                self.made = getattr(func, "__name__", str(func))
        return out


def int8_row(row: list[float]) -> tuple[float, list[float]]:
    """The int8 quantizer of one row (chapter 10), in float64: its scale, absmax / 127 rounded to float32, and
    each value's x / scale clamped to [-127, 127] (0 if the scale is), whose nearest integer is its code."""
    scale = struct.unpack("f", struct.pack("f", max(map(abs, row)) / 127))[0]
    return scale, [max(-127.0, min(127.0, v / scale)) if scale else 0.0 for v in row]
