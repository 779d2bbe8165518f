"""`check(name, impl)`: run a part's conformance suite and say, in a few lines, whether it passes.

The suite runs `programs` random programs (a seeded `random.Random`, so the same part always gets
the same programs and the same report: a notebook's output does not change from run to run),
each call judged against a brute-force reference (`kvlearn.parts.references`), never against the
part's own checks. The first program that fails is shrunk by hand: operations are dropped one at a
time while the program still fails (each operation draws its arguments from a seed of its own, so
a shorter program replays the rest unchanged), and the report shows the calls of the shortest
one, what was expected and what came back, and a hint in the chapter's words.

Whatever the part does, `check` returns a report: an exception, an answer of the wrong type, a
stub (`NotImplementedError`: "Not yet"), or a call that does not come back within the time limit
each become a failed report. The time limit is a `SIGALRM` timer when `check` runs in the main
thread (a notebook, a script) and no other alarm is pending: it stops a Python loop at its next
bytecode, not a long call into C (that one is stopped when it returns). Otherwise the suite runs in
a daemon thread that `check` waits for; a part stuck in an endless loop then keeps that thread
busy until the process ends.
"""

from __future__ import annotations

import inspect
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from types import ModuleType

from kvlearn.parts import (suite_allocator, suite_attention, suite_block_manager, suite_block_table,
                           suite_radix_cache, suite_scheduler)
from kvlearn.parts.allocator import AllocatorPart
from kvlearn.parts.attention import AttentionPart
from kvlearn.parts.block_manager import BlockManagerPart, BlockTablePart
from kvlearn.parts.radix_cache import RadixCachePart
from kvlearn.parts.scheduler import SchedulerPart
from kvlearn.parts.trace import Broken, Raised, Trace


@dataclass(frozen=True)
class Suite:
    module: ModuleType   # generate(rng) -> (setup, ops); run(impl, setup, ops, trace); HINTS
    contract: type       # the Protocol that lists the members the engine and pictures use
    chapter: str


SUITES = {
    "block_table": Suite(suite_block_table, BlockTablePart, "chapter 1"),
    "block_manager": Suite(suite_block_manager, BlockManagerPart, "chapters 1-2"),
    "radix_cache": Suite(suite_radix_cache, RadixCachePart, "chapter 3"),
    "allocator": Suite(suite_allocator, AllocatorPart, "chapter 4"),
    "attention": Suite(suite_attention, AttentionPart, "chapter 5"),
    "scheduler": Suite(suite_scheduler, SchedulerPart, "chapter 6"),
}


@dataclass(frozen=True)
class CheckReport:
    """What `check` found: `passed`, and `message` (a few lines to print)."""

    part: str
    impl: str
    passed: bool
    message: str
    programs: int = 0
    calls: int = 0

    def __repr__(self) -> str:
        return f"CheckReport({self.part}, {self.impl}: {'passed' if self.passed else 'FAILED'})\n{self.message}"

    __str__ = __repr__


class _Timeout(BaseException):
    """Raised by the alarm in the middle of the part's call (a BaseException: `except Exception`
    in the part does not swallow it)."""


def contract_members(contract: type) -> list[str]:
    """The methods and properties a part's class must have, the contract's own and those of the
    contracts it extends (its data attributes are set in __init__)."""
    return sorted({name for klass in contract.__mro__ for name, value in vars(klass).items()
                   if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})


def check(name: str, impl, time_limit_s: float = 10.0, programs: int = 300, seed: int = 0) -> CheckReport:
    """Run the conformance suite of part `name` (a key of `SUITES`: "block_table", "block_manager", ...) on
    `impl`, the part's class (built with the same arguments as the package's) or, for "attention", its
    function. `time_limit_s`:
    the most all programs may take together (a part still running then fails). Never raises
    because of the part; ValueError for an unknown `name`."""
    if name not in SUITES:
        raise ValueError(f"Unknown part {name!r}: the parts are {', '.join(map(repr, SUITES))}.")
    suite = SUITES[name]
    label = getattr(impl, "__name__", repr(impl))
    head = f"{label} does not meet the {name} contract ({suite.chapter}, kvlearn.parts.{suite.contract.__name__})."
    if not callable(impl):
        return CheckReport(name, label, False, f"{head}\nGive the part's class (built like the package's; for "
                                               f"attention, the function), "
                                               f"not {type(impl).__name__} {impl!r}.")
    if inspect.isclass(impl):
        missing = [m for m in contract_members(suite.contract) if not _has(impl, m)]
        if missing:
            return CheckReport(name, label, False, f"Not yet: {label} lacks {', '.join(missing)}.\n{head}\n"
                               f"Hint: write each member the contract lists (help(kvlearn.parts."
                               f"{suite.contract.__name__})); a base class holds the bookkeeping the chapter "
                               "does not teach (kvlearn.parts).")
    rng, calls, deadline = random.Random(seed), 0, time.monotonic() + time_limit_s
    for i in range(programs):
        setup, ops = suite.module.generate(rng)
        outcome = _run(suite, impl, setup, ops, deadline - time.monotonic())
        calls += outcome[2].calls
        if outcome[0] != "ok":
            if outcome[0] != "timeout":
                ops, outcome = _shrink(suite, impl, setup, ops, outcome, time.monotonic() + time_limit_s)
            return CheckReport(name, label, False, _failure(head, suite, i, programs, ops, outcome, time_limit_s),
                               i + 1, calls)
    judge = getattr(suite.module, "JUDGE", "a brute-force reference")   # a suite may name its own
    return CheckReport(name, label, True, f"{label} meets the {name} contract ({suite.chapter}): {programs} random "
                       f"programs, {calls} calls, each judged by {judge}.", programs, calls)


def _has(cls: type, member: str) -> bool:
    try:
        inspect.getattr_static(cls, member)
    except AttributeError:
        return False
    return True


def _run(suite: Suite, impl, setup: dict, ops: list, seconds: float) -> tuple[str, object, Trace]:
    """Run one program: ("ok" | "broken" | "raised" | "stub" | "timeout" | "unreadable", detail, trace)."""
    trace = Trace()

    def body():
        try:
            suite.module.run(impl, setup, ops, trace)
        except Broken as broken:
            return "broken", broken
        except Raised as raised:
            return ("stub" if isinstance(raised.error, NotImplementedError) else "raised"), raised.error
        except (Exception, SystemExit) as error:   # the checker could not use what the part returned
            return "unreadable", error
        return "ok", None

    if seconds <= 0:
        return "timeout", None, trace
    if (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0):   # nobody else's alarm is pending
        def alarm(signum, frame):
            raise _Timeout

        previous = signal.signal(signal.SIGALRM, alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                return (*body(), trace)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            return "timeout", None, trace
        finally:
            signal.signal(signal.SIGALRM, previous)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(body()), daemon=True)
    worker.start()
    worker.join(seconds)
    return (*result[0], trace) if result else ("timeout", None, trace)


def _shrink(suite: Suite, impl, setup: dict, ops: list, outcome: tuple, deadline: float, max_runs: int = 400):
    """Drop operations while the program still fails the same way (same kind of failure)."""
    ops = ops[:outcome[2].op + 1]   # nothing after the failing operation matters
    i, runs = len(ops) - 2, 0
    while i >= 0 and runs < max_runs and time.monotonic() < deadline:
        shorter = ops[:i] + ops[i + 1:]
        attempt = _run(suite, impl, setup, shorter, deadline - time.monotonic())
        runs += 1
        if attempt[0] == outcome[0]:
            ops, outcome = shorter[:attempt[2].op + 1], attempt
            i = min(i, len(ops) - 1)
        i -= 1
    return ops, outcome


def _failure(head: str, suite: Suite, index: int, programs: int, ops: list, outcome: tuple, limit: float) -> str:
    kind, detail, trace = outcome
    last = trace.lines[-1] if trace.lines else "building the part"
    calls = "\n".join("    " + line for line in trace.lines)
    hint = _call_hint(suite, last)
    if kind == "broken":
        what, hint = f"{detail.what}.", detail.hint
    elif kind == "stub":
        head = f"Not yet: `{last.split('  ->')[0].strip()}` raises NotImplementedError (a stub).\n{head}"
        what = "Write that method (the calls above lead to it)."
    elif kind == "raised":
        what = f"It raised {type(detail).__name__}: {detail}; the rules say this call succeeds here."
    elif kind == "timeout":
        what = (f"The last call did not return within {limit:g} s (all programs together): an endless loop? "
                "(a while loop whose condition never changes, a walk that never reaches the root or a leaf)")
    else:
        what = (f"The checker could not use what the part returned ({type(detail).__name__}: {detail}): "
                f"return what kvlearn.parts.{suite.contract.__name__} says.")
    shown = "The calls" if kind == "timeout" else f"A smallest example (program {index + 1} of {programs}, shrunk)"
    return f"{head}\n{shown}:\n{calls}\n{what}\nHint: {hint}"


def _call_hint(suite: Suite, line: str) -> str:
    """The suite's hint for the method the line calls, or its first hint."""
    hints = suite.module.HINTS
    for method in re.findall(r"\.(\w+)\(", line)[::-1]:
        for key, hint in hints.items():
            if key in method or method in key:
                return hint
    return next(iter(hints.values()))
