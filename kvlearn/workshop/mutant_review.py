"""What a part observably does on its suite's programs: the review of equivalent mutants.

An equivalent mutant (tests/data/mutants/) must pass `check` and answer every call of the first
programs of its suite exactly as the worked solution does (float tensors within a tolerance);
`observe` records those answers and `first_difference` says where two records part.
"""

from __future__ import annotations

import random

import torch

from kvlearn.parts.conformance import SUITES
from kvlearn.parts.judge import Trace


class Recorder(Trace):
    """A trace that also keeps what every call of the part returned (`answers`, as plain data)."""

    def __init__(self):
        super().__init__()
        self.answers: list = []

    def call(self, line: str, fn, *args, quiet: bool = False, **kwargs):
        result = super().call(line, fn, *args, quiet=quiet, **kwargs)
        self.answers.append(plain(result))
        return result


def plain(value):
    """What a part's answer shows: numbers, strings and integer tensors as they are, float tensors
    as tensors (compared with a tolerance), a match as its length and slots, anything else by type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone() if value.is_floating_point() else (str(value.dtype), value.tolist())
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "indices") and hasattr(value, "last_node"):
        return "match", len(value), plain(value.indices)
    return type(value).__name__


def observe(part: str, impl, programs: int = 100, seed: int = 0) -> list:
    """What `impl` does on the first `programs` programs of its suite (`check`'s, same seed): per
    program, the trace's lines, every answer, and how the run ended (None, or the exception)."""
    suite, rng, seen = SUITES[part], random.Random(seed), []
    for _ in range(programs):
        setup, ops = suite.module.generate(rng)
        trace = Recorder()
        try:
            suite.module.run(impl, setup, ops, trace)
            ending = None
        except Exception as error:   # recorded, not raised: two parts may fail alike
            ending = f"{type(error).__name__}: {error}"
        seen.append((trace.lines, trace.answers, ending))
    return seen


def first_difference(a, b, where: str = "") -> str | None:
    """Where two observations differ (float tensors within 1e-5 relative), or None when they agree."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a, b, rtol=1e-5, atol=1e-6))
        return None if same else f"{where}: {a} != {b}"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := first_difference(x, y, f"{where}[{i}]"))),
                    None)
    return None if a == b else f"{where}: {a!r} != {b!r}"
