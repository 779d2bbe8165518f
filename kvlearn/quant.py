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
`quality_table` does it for several formats (the first one the reference), e.g. over the README:
`python -c 'import kvlearn; from kvlearn.quant import quality_table; m, t = kvlearn.load_model();
print(*quality_table(m, t.encode(open("README.md").read())[:512]), sep="\\n")'`.
The Triton kernels (`kvlearn.kernels`) and the fast path read the pool raw: the engine serves these
formats with chapter 5's torch attention only (`EngineConfig` refuses the others).
"""

from __future__ import annotations

import math

import torch

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
                      chunk: int = 128) -> tuple[float, float | None, torch.Tensor]:
    """Teacher-forced quality of a format through the paged runner: (perplexity of token_ids[1:],
    mean KL(reference || this) over positions or None without a reference, log-probs [n - 1, vocab]).
    Position i's next-token distribution is the last-token logits of the sequence token_ids[:i + 1]:
    each chunk runs as one packed step of one-token sequences that share the pool's slots, so every
    query reads its context back from the (quantized) pool, as in serving."""
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"Need at least 2 tokens to score a next token, got {n}.")
    pool = KVPool.for_model(model.config, num_slots=n, dtype=model.dtype, device=model.device,
                            kv_cache_dtype=kv_cache_dtype)
    runner, slots = ModelRunner(model, pool), pool.alloc(n)
    logps = []
    for start in range(0, n - 1, chunk):
        ends = range(start + 1, min(start + chunk, n - 1) + 1)
        logits = runner.run([[token_ids[e - 1]] for e in ends], [slots[:e] for e in ends])
        logps.append(torch.log_softmax(logits.double(), -1))
    logp = torch.cat(logps)
    nll = -logp.gather(1, torch.tensor(token_ids[1:], device=logp.device)[:, None]).mean()
    kl = None if reference is None else float((reference.exp() * (reference - logp)).sum(-1).mean())
    return math.exp(float(nll)), kl, logp


def quality_table(model, token_ids: list[int], names=("auto", "bfloat16", "fp8_e4m3", "int8")) -> list[dict]:
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
