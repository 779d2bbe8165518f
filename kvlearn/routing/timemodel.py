"""How long one engine step takes, so a fleet can be simulated without running the model.

A step (chapter 6) computes some prefill tokens and one decode token for each running request, in
one forward pass. Its time is modelled as

    step_s = overhead_s + prefill_s_per_token * prefill_tokens
                        + decode_s_per_seq * decode_seqs + attention_s_per_context_token * context_tokens
                        + load_s_per_token * loaded_tokens

where context_tokens is the sum, over the batch's requests, of the tokens each one attends to
(its whole context), and loaded_tokens the cached tokens the step's admissions copied in from
below the replica's pool (a shared pool, `kvlearn.routing.pooled`; 0 by default). The first four
coefficients are measured on the real model by `calibrate()` (least squares over timed forward
passes, the fastest of several rounds) and stored as a small JSON file; `default_time_model()`
reads the one committed with kvlearn, measured on the machine the course was built on.
`faster(k)` is a what-if: every compute coefficient divided by k (loading is I/O: unchanged).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvlearn.errors import check_positive_int

DEFAULT_PATH = Path(__file__).with_name("time_model.json")


@dataclass(frozen=True)
class TimeModel:
    """Seconds per step as a linear function of the step's work (see the module docstring)."""

    overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    attention_s_per_context_token: float
    measured_on: str = ""
    load_s_per_token: float = 0.0

    COMPUTE = ("overhead_s", "prefill_s_per_token", "decode_s_per_seq", "attention_s_per_context_token")

    def __post_init__(self):
        for name in self.COMPUTE + ("load_s_per_token",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"TimeModel.{name} must be a number >= 0, got {value!r}.")

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, loaded_tokens: int = 0) -> float:
        return (self.overhead_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs
                + self.attention_s_per_context_token * context_tokens + self.load_s_per_token * loaded_tokens)

    def faster(self, k: float) -> TimeModel:
        """A what-if: replicas `k` times faster at computing (every compute coefficient / k; loading
        unchanged), e.g. to stand for GPU replicas where the measured CPU ones cannot keep up."""
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k < math.inf:
            raise ValueError(f"k must be a number > 0, got {k!r}.")
        if k == 1:
            return self
        return replace(self, **{name: getattr(self, name) / k for name in self.COMPUTE},
                       measured_on=f"{self.measured_on}; compute {k:g}x faster (what-if)")

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path) -> TimeModel:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No time model at {path}: "
                                    f"run `python -m kvlearn route --calibrate --time-model {path}`.")
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path} is not a kvlearn time model ({e}): re-create it with `route --calibrate`.") from e

    def __repr__(self) -> str:
        return (f"TimeModel({self.overhead_s * 1e3:.2f} ms/step + "
                f"{self.prefill_s_per_token * 1e3:.3f} ms/prefill token + "
                f"{self.decode_s_per_seq * 1e3:.3f} ms/decode seq + {self.attention_s_per_context_token * 1e6:.3f} "
                f"us/context token" + (f" + {self.load_s_per_token * 1e6:.1f} us/loaded token" if self.load_s_per_token
                                       else "") + ")")


def default_time_model() -> TimeModel:
    """The time model committed with kvlearn (SmolLM2-135M, float32, measured on the course's CPU)."""
    return TimeModel.load(DEFAULT_PATH)


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def calibrate(model=None, rounds: int = 5, progress=print) -> TimeModel:
    """Time real forward passes of the model (prefills of several lengths, decode batches of several
    sizes and contexts) and fit the TimeModel by least squares.

    Every probe runs once per round and keeps its fastest time: other work on the machine only ever
    slows a pass down, so the minimum over rounds spread in time is the least disturbed measurement."""
    import os

    import torch

    from kvlearn.model import load_model
    from kvlearn.pool import KVPool
    from kvlearn.runner import ModelRunner

    check_positive_int("rounds", rounds)
    if model is None:
        model, _ = load_model()
    pool = KVPool.for_model(model.config, num_slots=8192, dtype=model.dtype, device=model.device)
    runner = ModelRunner(model, pool)
    context = pool.alloc(4096)   # a shared context for the decode probes: its values do not matter
    # (prefill tokens, decoding requests, context each decoding request attends to)
    probes = [(n, 0, 1) for n in (32, 128, 512, 1024)] + [(0, b, c) for b in (1, 4, 16, 32) for c in (128, 2048)]
    probes.append((256, 8, 512))

    def run(prefill: int, seqs: int, ctx: int) -> float:
        ids, indices = [], []
        fresh = pool.alloc(prefill + seqs)
        if prefill:
            ids.append([5] * prefill)
            indices.append(fresh[:prefill])
        for i in range(seqs):
            ids.append([5])
            indices.append(torch.cat([context[:ctx - 1], fresh[prefill + i:prefill + i + 1]]))
        start = time.perf_counter()
        runner.forward(ids, indices)
        seconds = time.perf_counter() - start
        pool.free(fresh)
        return seconds

    run(32, 4, 128)   # warm up
    best = [float("inf")] * len(probes)
    for _ in range(rounds):
        for k, probe in enumerate(probes):
            best[k] = min(best[k], run(*probe))
    rows = [[1.0, prefill, seqs, seqs * ctx + prefill] for prefill, seqs, ctx in probes]
    for (prefill, seqs, ctx), seconds in zip(probes, best, strict=True):
        progress(f"  prefill {prefill:>4} + {seqs:>2} decodes x {ctx:>4} context: {seconds * 1e3:7.1f} ms")
    coef = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                              torch.tensor(best, dtype=torch.float64)[:, None]).solution
    a, b, c, d = (max(float(x), 0.0) for x in coef[:, 0])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return TimeModel(a, b, c, d, measured_on=f"{_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                                             f"{torch.get_num_threads()} threads, {model.dtype}, {model.device}, "
                                             f"best of {rounds} rounds, load average {load:.1f} after, "
                                             f"{time.strftime('%Y-%m-%d')}")
