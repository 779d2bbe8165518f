"""`check(name, impl)`: run a part's conformance suite and say, in a few lines, whether it passes.

The suite runs random programs (a seeded `random.Random`: the same part always gets the same
programs and the same report, so a notebook's output does not change from run to run), each call
judged against a brute-force reference (`kvlearn.parts.references`), never against the part's own
checks. The first program that fails is shrunk: operations are dropped one at a time while the
program still fails the same way (each operation draws its arguments from a seed of its own, so a
shorter program replays the rest unchanged), and the report shows the calls of the shortest one,
what was expected and what came back, and the hint of the rule that was broken, in the chapter's words.

Whatever the part does, `check` returns a report: an exception (a stub's NotImplementedError is
"Not yet"), an answer of the wrong type, or a call that runs past `time_limit_s` (an endless loop:
`kvlearn.parts.judge` says how the limit works) each become a failed report. A real Ctrl-C stops
the check. That the package's own parts pass their suites is kvlearn's test (tests/test_parts.py).
"""

from __future__ import annotations

import inspect
import math
import random
import time
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType

from kvlearn.errors import check_positive_int
from kvlearn.parts.judge import Broken, Raised, TimeUp, Trace, describe
from kvlearn.serving.part_registry import REGISTRY, PartRecord

MAX_SHRINK_RUNS = 400


@dataclass(frozen=True)
class Suite:
    """The facts of one part: its record (name, chapters, the package's part: kvlearn.serving.part_registry)
    and its suite module `kvlearn.parts.suite_NAME`: the contract (`CONTRACT`, the Protocol of the
    members the engine and pictures use), the hints (`HINTS`, rule -> hint in the chapter's words),
    `generate(rng) -> (setup, ops)`, `run(impl, setup, ops, trace)`, and what judges each call (`JUDGE`)."""

    record: PartRecord
    module: ModuleType

    @property
    def package(self):
        return self.record.package

    @property
    def contract(self) -> type:
        return self.module.CONTRACT

    @property
    def judge(self) -> str:
        return getattr(self.module, "JUDGE", "a brute-force reference")


# In the registry's order.
SUITES = {r.name: Suite(r, import_module(f"kvlearn.parts.suite_{r.name}")) for r in REGISTRY}


@dataclass(frozen=True)
class CheckReport:
    """What `check` found: `passed`, and `message` (a few lines to print); `seconds`: the time the
    part spent in its calls."""

    part: str
    impl: str
    passed: bool
    message: str
    programs: int = 0
    calls: int = 0
    seconds: float = 0.0

    def __repr__(self) -> str:
        return f"CheckReport({self.part}, {self.impl}: {'passed' if self.passed else 'FAILED'})\n{self.message}"

    __str__ = __repr__


def contract_members(contract: type) -> list[str]:
    """The methods and properties of `contract` and of the contracts it extends (its data attributes
    are set in __init__, so they are not asked for)."""
    return sorted({name for klass in contract.__mro__ for name, value in vars(klass).items()
                   if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})


def missing_members(contract: type, impl) -> list[str]:
    """The members of `contract` that the class `impl` lacks ([] for a function)."""
    return [m for m in contract_members(contract) if not _has(impl, m)] if inspect.isclass(impl) else []


def checked(name: str, part):
    """`part` when it has every member of its contract (a function: when it is no class), else TypeError."""
    if name == "attention" and isinstance(part, type):
        raise TypeError(f"parts['attention'] is a function like kvlearn.attention.paged_attention, got the class "
                        f"{part.__qualname__}.")
    contract = SUITES[name].contract
    missing = missing_members(contract, part)
    if missing:
        raise TypeError(f"parts[{name!r}] ({part.__qualname__}) lacks {', '.join(missing)}: the {name} contract "
                        f"(kvlearn.parts.{contract.__name__}) lists them; write each one (help(kvlearn.parts."
                        f"{contract.__name__})), then check the part with kvlearn.parts.check({name!r}, "
                        f"{part.__qualname__}).")
    return part


def _has(cls: type, member: str) -> bool:
    try:
        inspect.getattr_static(cls, member)
    except AttributeError:
        return False
    return True


def check(name: str, impl, time_limit_s: float | None = None, programs: int | None = None,
          seed: int = 0, case: int | None = None) -> CheckReport:
    """Run the conformance suite of part `name` (a key of `SUITES`: "block_table", "block_manager", ...)
    on `impl`, the part's class (built with the same arguments as the package's) or, for "attention",
    its function, over `programs` random programs drawn from `seed`; a call may take `time_limit_s`.
    None: the suite's `PROGRAMS` and `TIME_LIMIT_S` if it has them, else 300 programs and 2 s. `case`
    (from 1): run that program of `seed`'s alone, the one a failure report names, to try a fix on it.
    Never raises because of the part; ValueError or TypeError for an unknown `name`, `programs` or
    `case` < 1 or not an int, a time limit that is not a finite number > 0."""
    if name not in SUITES:
        raise ValueError(f"Unknown part {name!r}: the parts are {', '.join(map(repr, SUITES))}.")
    module = SUITES[name].module
    time_limit_s = getattr(module, "TIME_LIMIT_S", 2.0) if time_limit_s is None else time_limit_s
    programs = getattr(module, "PROGRAMS", 300) if programs is None else programs
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)):
        raise TypeError(f"time_limit_s must be a number of seconds, got {time_limit_s!r}.")
    if not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a finite number of seconds > 0, got {time_limit_s!r}.")
    check_positive_int("programs", programs, " (random programs to run)")
    if case is not None:
        programs = check_positive_int("case", case, " (a random case's number, from 1)")
    suite, label = SUITES[name], _label(impl)
    contract = f"kvlearn.parts.{suite.contract.__name__}"
    head = f"{label} does not meet the {name} contract ({suite.record.taught}, {contract})."
    if not callable(impl):
        return CheckReport(name, label, False, f"{head}\nGive the part's class (built like the package's; for "
                                               f"attention, the function), not {type(impl).__name__} {label}.")
    missing, unmet = missing_members(suite.contract, impl), getattr(suite.module, "unmet", lambda: None)()
    if unmet:   # what the suite itself needs here (Triton, for the kernel)
        return CheckReport(name, label, False, f"{head}\nIt cannot be checked here: {unmet}")
    if missing:
        return CheckReport(name, label, False, f"Not yet: {label} lacks {', '.join(missing)}.\n{head}\nHint: write "
                           f"each member the contract lists (help(kvlearn.parts.{suite.contract.__name__})); a base "
                           "class holds the bookkeeping the chapter does not teach (kvlearn.parts).")
    rng, calls, seconds = random.Random(seed), 0, 0.0
    for i in range(programs):
        setup, ops = suite.module.generate(rng)
        if case is not None and i + 1 < case:   # drawn, to reach the case's own draw, and not run
            continue
        outcome = _run(suite, impl, setup, ops, time_limit_s)
        calls, seconds = calls + outcome[2].calls, seconds + outcome[2].seconds
        if outcome[0] != "ok":
            if outcome[0] != "timeout":
                ops, outcome = _shrink(suite, impl, setup, ops, outcome, time_limit_s)
            again = f"kvlearn.parts.check({name!r}, {label}, case={i + 1}{f', seed={seed}' if seed else ''})"
            return CheckReport(name, label, False, _failure(head, suite, again, outcome, time_limit_s),
                               i + 1, calls, seconds)
    ran = f"{programs} random programs" if case is None else f"random case {case} alone"
    return CheckReport(name, label, True, f"{label} meets the {name} contract ({suite.record.taught}): {ran}, "
                       f"{calls} calls, each judged by {suite.judge}.\nIts calls took "
                       f"{_seconds(seconds)} in all.", programs, calls, seconds)


def _label(impl) -> str:
    name = getattr(impl, "__name__", None)
    if isinstance(name, str):
        return name
    try:
        return repr(impl)
    except Exception:   # a part's own __repr__ may fail in any way
        return type(impl).__name__


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _run(suite: Suite, impl, setup: dict, ops: list, limit_s: float) -> tuple[str, object, Trace]:
    """Run one program: ("ok" | "broken" | "raised" | "stub" | "unreadable" | "timeout", detail, trace)."""
    trace = Trace(limit_s)
    try:
        suite.module.run(impl, setup, ops, trace)
    except Broken as broken:
        return "broken", broken, trace
    except Raised as raised:
        return ("stub" if isinstance(raised.error, NotImplementedError) else "raised"), raised.error, trace
    except TimeUp:
        return "timeout", None, trace
    except Exception as error:   # the suite could not use what the part returned
        return "unreadable", error, trace
    return "ok", None, trace


def _shrink(suite: Suite, impl, setup: dict, ops: list, outcome: tuple, limit_s: float):
    """Drop operations while the program still fails the same way (same kind of failure)."""
    ops = ops[:outcome[2].op + 1]   # nothing after the failing operation matters
    i, deadline = len(ops) - 2, time.perf_counter() + 30 * limit_s
    for _ in range(MAX_SHRINK_RUNS):
        if i < 0 or time.perf_counter() > deadline:
            break
        shorter = ops[:i] + ops[i + 1:]
        attempt = _run(suite, impl, setup, shorter, limit_s)
        if attempt[0] == outcome[0]:
            ops, outcome = shorter[:attempt[2].op + 1], attempt
            i = min(i, len(ops) - 1)
        i -= 1
    return ops, outcome


def _failure(head: str, suite: Suite, again: str, outcome: tuple, limit_s: float) -> str:
    kind, detail, trace = outcome
    last = trace.lines[-1] if trace.lines else "building the part"
    calls = "\n".join("    " + line for line in trace.lines)
    contract = f"kvlearn.parts.{suite.contract.__name__}"
    hint = suite.module.HINTS.get(trace.method, f"read what the contract says of this call: help({contract}).")
    if kind == "broken":
        what, hint = f"{detail.what}.", detail.hint
    elif kind == "stub":
        head = f"Not yet: `{last.split('  ->')[0].strip()}` raises NotImplementedError (a stub).\n{head}"
        what = "Write that method (the calls above lead to it)."
    elif kind == "raised":
        what = f"It raised {describe(detail)}; the rules say this call succeeds here."
    elif kind == "timeout":
        what = f"The last call did not return within {limit_s:g} s."
        hint = ("an endless loop? (a while loop whose condition never changes, a walk that never reaches the root "
                "or a leaf)")
    else:
        what = (f"The checker could not use what the part returned ({describe(detail)}): return what {contract} "
                "says. If it does, this is a bug in kvlearn's checker: please report it, with this message.")
    shown = "The calls" if kind == "timeout" else "A smallest example, shrunk"
    shown += f" (this case alone, to try a fix: {again})"
    return f"{head}\n{shown}:\n{calls}\n{what}\nHint: {hint}"
