"""`check(name, impl)`: run a part's conformance suite and say, in a few lines, whether it passes.

The suite runs `programs` random programs (a seeded `random.Random`, so the same part always gets
the same programs and the same report: a notebook's output does not change from run to run),
each call judged against a brute-force reference (`kvlearn.parts.references`), never against the
part's own checks. The first program that fails is shrunk by hand: operations are dropped one at a
time while the program still fails (each operation draws its arguments from a seed of its own, so
a shorter program replays the rest unchanged), and the report shows the calls of the shortest
one, what was expected and what came back, and a hint in the chapter's words.

Whatever the part does, `check` returns a report: an exception of any kind (a KeyboardInterrupt
or another BaseException raised by the part's own code included), an answer of the wrong type, a
stub (`NotImplementedError`: "Not yet"), or a call that does not come back in time each become a
failed report. A real Ctrl-C still stops the check: each program runs in a worker thread, and the
thread that called `check` (the one a Ctrl-C reaches) only waits for it.

Time limits catch endless loops, not slow laptops. Each program runs first with the package's own
part (`Suite.reference`, the code the chapter ends with), timed on the same machine in the same
check, then with the part. A call of the part fails when it runs longer than max(time_limit_s,
CALL_FACTOR x the reference's slowest call so far); the part's runs, all programs together, when
they take longer than max(TOTAL_FLOORS x time_limit_s, TOTAL_FACTOR x the reference's runs so far).
A part past its limit is stopped at its next Python bytecode (an exception raised in its thread; a
long call into C stops when it returns, a part that swallows the exception keeps its thread busy),
and the check reports at once, without waiting for it. The passing report says how long the part's
calls took beside the reference's.

What fails in kvlearn's own code (a suite's program, the reference part failing its own suite) is
reported as a bug of the checker, never as the part's. The checker's modules (this one, `trace`,
`references`, the suites) are imported with `kvlearn.parts`, before any part (kvlearn.exercises.parts
imports them when it loads). `check` keeps a snapshot of them as imported: what a part replaced
(a function, a member of one of their classes, `kvlearn.parts.check`) is put back before a run,
and a run that replaced something fails, saying what.
"""

from __future__ import annotations

import ctypes
import inspect
import math
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType

from kvlearn.allocator import PageAllocator
from kvlearn.attention import paged_attention
from kvlearn.blocks import BlockManager
from kvlearn.errors import check_positive_int
from kvlearn.parts import (references, suite_allocator, suite_attention, suite_block_manager, suite_block_table,
                           suite_radix_cache, suite_scheduler, trace as trace_module)
from kvlearn.parts.allocator import AllocatorPart
from kvlearn.parts.attention import AttentionPart
from kvlearn.parts.block_manager import BlockManagerPart, BlockTablePart
from kvlearn.parts.radix_cache import RadixCachePart
from kvlearn.parts.scheduler import SchedulerPart
from kvlearn.parts.trace import Broken, Raised, TimeUp, Trace, describe
from kvlearn.radix import RadixCache
from kvlearn.serving.scheduler import Scheduler

CALL_FACTOR = 100          # a call may take this many times the reference's slowest call (at least time_limit_s)
TOTAL_FACTOR = 50          # the part's runs: this many times the reference's (at least TOTAL_FLOORS x time_limit_s)
TOTAL_FLOORS = 30
REFERENCE_LIMIT_S = 120.0  # the reference's own runs (kvlearn's code: past this, the checker is at fault)
POLL_S = 0.02              # how often the waiting thread looks at the clock
GRACE_S = 0.5              # how long it waits for a stopped part's thread to end


@dataclass(frozen=True)
class Suite:
    module: ModuleType   # generate(rng) -> (setup, ops); run(impl, setup, ops, trace); HINTS
    contract: type       # the Protocol that lists the members the engine and pictures use
    chapter: str
    reference: object    # the package's own part: the time yardstick, and the suite's own test


SUITES = {
    "block_table": Suite(suite_block_table, BlockTablePart, "chapter 1", BlockManager),
    "block_manager": Suite(suite_block_manager, BlockManagerPart, "chapters 1-2", BlockManager),
    "radix_cache": Suite(suite_radix_cache, RadixCachePart, "chapter 3", RadixCache),
    "allocator": Suite(suite_allocator, AllocatorPart, "chapter 4", PageAllocator),
    "attention": Suite(suite_attention, AttentionPart, "chapter 5", paged_attention),
    "scheduler": Suite(suite_scheduler, SchedulerPart, "chapter 6", Scheduler),
}


@dataclass(frozen=True)
class CheckReport:
    """What `check` found: `passed`, and `message` (a few lines to print). `seconds`: the time the
    part spent in its calls; `reference_seconds`: the package's part in the same calls."""

    part: str
    impl: str
    passed: bool
    message: str
    programs: int = 0
    calls: int = 0
    seconds: float = 0.0
    reference_seconds: float = 0.0

    def __repr__(self) -> str:
        return f"CheckReport({self.part}, {self.impl}: {'passed' if self.passed else 'FAILED'})\n{self.message}"

    __str__ = __repr__


def contract_members(contract: type) -> list[str]:
    """The methods and properties a part's class must have, the contract's own and those of the
    contracts it extends (its data attributes are set in __init__)."""
    return sorted({name for klass in contract.__mro__ for name, value in vars(klass).items()
                   if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})


@dataclass
class _Clock:
    """The time limits of one check, from the reference's runs of the same programs so far."""

    floor_s: float                   # time_limit_s
    reference_s: float = 0.0         # the reference's runs, wall time
    reference_calls_s: float = 0.0   # inside its calls
    reference_slowest_s: float = 0.0
    part_s: float = 0.0
    part_calls_s: float = 0.0

    def call_limit(self) -> float:
        return max(self.floor_s, CALL_FACTOR * self.reference_slowest_s)

    def total_limit(self) -> float:
        return max(TOTAL_FLOORS * self.floor_s, TOTAL_FACTOR * self.reference_s)


def _check(name: str, impl, time_limit_s, programs, seed, restore, changed: list[str]) -> CheckReport:
    """`check`'s work, once the checker is as imported again (`changed`: what was not; `restore()` puts
    it back again and says what had changed)."""
    if name not in SUITES:
        raise ValueError(f"Unknown part {name!r}: the parts are {', '.join(map(repr, SUITES))}.")
    _check_seconds("time_limit_s", time_limit_s)
    check_positive_int("programs", programs, " (random programs to run)")
    suite = SUITES[name]
    label = _label(impl)
    head = f"{label} does not meet the {name} contract ({suite.chapter}, kvlearn.parts.{suite.contract.__name__})."
    if changed:
        return CheckReport(name, label, False, _changed(head, changed, "since it was imported"))
    if not callable(impl):
        return CheckReport(name, label, False, f"{head}\nGive the part's class (built like the package's; for "
                                               f"attention, the function), "
                                               f"not {type(impl).__name__} {label}.")
    if inspect.isclass(impl):
        missing = [m for m in contract_members(suite.contract) if not _has(impl, m)]
        if missing:
            return CheckReport(name, label, False, f"Not yet: {label} lacks {', '.join(missing)}.\n{head}\n"
                               f"Hint: write each member the contract lists (help(kvlearn.parts."
                               f"{suite.contract.__name__})); a base class holds the bookkeeping the chapter "
                               "does not teach (kvlearn.parts).")
    rng, calls, clock = random.Random(seed), 0, _Clock(time_limit_s)
    for i in range(programs):
        try:
            setup, ops = suite.module.generate(rng)
        except (Exception, SystemExit) as error:   # a real Ctrl-C (KeyboardInterrupt) goes on up
            return _checker_bug(name, label, f"making program {i + 1} raised {describe(error)}")
        start = time.perf_counter()
        reference = _run(suite, suite.reference, setup, ops, REFERENCE_LIMIT_S, start + REFERENCE_LIMIT_S)
        if reference[0] != "ok":
            return _checker_bug(name, label, f"the package's own {_label(suite.reference)} fails program {i + 1}: "
                                             f"{_what(suite, reference)}")
        clock.reference_s += time.perf_counter() - start
        clock.reference_calls_s += reference[2].seconds
        clock.reference_slowest_s = max(clock.reference_slowest_s, reference[2].slowest)
        start = time.perf_counter()
        outcome = _run(suite, impl, setup, ops, clock.call_limit(), start + clock.total_limit() - clock.part_s)
        clock.part_s += time.perf_counter() - start
        clock.part_calls_s += outcome[2].seconds
        calls += outcome[2].calls
        if outcome[0] not in ("ok", "timeout"):
            ops, outcome = _shrink(suite, impl, setup, ops, outcome, clock)
        changed = restore()
        if changed:
            return CheckReport(name, label, False, _changed(head, changed, "while the programs ran"), i + 1, calls)
        if outcome[0] != "ok":
            return CheckReport(name, label, False, _failure(head, suite, i, programs, ops, outcome, clock),
                               i + 1, calls, clock.part_calls_s, clock.reference_calls_s)
    judge = getattr(suite.module, "JUDGE", "a brute-force reference")   # a suite may name its own
    return CheckReport(name, label, True, f"{label} meets the {name} contract ({suite.chapter}): {programs} random "
                       f"programs, {calls} calls, each judged by {judge}.\nIts calls took "
                       f"{_seconds(clock.part_calls_s)} in all; the package's {_label(suite.reference)}, "
                       f"{_seconds(clock.reference_calls_s)} in the same calls.", programs, calls,
                       clock.part_calls_s, clock.reference_calls_s)


def _check_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}.")
    return value


def _label(impl) -> str:
    name = getattr(impl, "__name__", None)
    if isinstance(name, str):
        return name
    try:
        return repr(impl)
    except Exception:   # a part's own __repr__ may fail in any way
        return type(impl).__name__


def _has(cls: type, member: str) -> bool:
    try:
        inspect.getattr_static(cls, member)
    except AttributeError:
        return False
    return True


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _checker_bug(name: str, label: str, what: str) -> CheckReport:
    return CheckReport(name, label, False, f"kvlearn's checker failed, not {label}: {what}.\nThis is a bug in "
                                           "kvlearn's checker, please report it (with this message); your part "
                                           "was not judged.")


def _changed(head: str, changed: list[str], when: str) -> str:
    return (f"{head}\nkvlearn's checker was changed {when}: {', '.join(changed)} (put back as kvlearn imported "
            f"it).\nHint: a part must not replace kvlearn's functions or their members; run the check again "
            f"(in a fresh kernel if the part did so when it was imported).")


def _raise_in(thread_id: int, error: type[BaseException] | None) -> None:
    """Raise `error` in the thread `thread_id` at its next bytecode; None: drop one not raised yet
    (CPython's PyThreadState_SetAsyncExc)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               None if error is None else ctypes.py_object(error))


def _run(suite: Suite, impl, setup: dict, ops: list, call_limit_s: float,
         deadline: float) -> tuple[str, object, Trace]:
    """Run one program: ("ok" | "broken" | "raised" | "stub" | "unreadable" | "timeout", detail,
    trace); a timeout's detail is "call" (one call ran past `call_limit_s`) or "total" (the run went
    past `deadline`, a `time.perf_counter()`). The program runs in a worker thread; this one waits,
    and a real Ctrl-C here stops the worker and goes on up."""
    trace, outcome, guard, live = Trace(), [], threading.Lock(), [True]

    def body():
        try:
            suite.module.run(impl, setup, ops, trace)
        except Broken as broken:
            return "broken", broken
        except Raised as raised:
            return ("stub" if isinstance(raised.error, NotImplementedError) else "raised"), raised.error
        except TimeUp:
            return "timeout", "call"
        except BaseException as error:   # the checker could not use what the part returned
            return "unreadable", error
        return "ok", None

    def work():
        try:
            result = body()
            with guard:            # from here on, nobody stops this thread
                live[0] = False
            _raise_in(threading.get_ident(), None)   # a stop sent just before: dropped
        except TimeUp:             # one sent just after body() returned
            result = "timeout", "call"
        outcome.append(result)

    def stop():
        with guard:
            if live[0]:
                live[0] = False
                _raise_in(worker.ident, TimeUp)

    if deadline <= time.perf_counter():
        return "timeout", "total", trace
    worker = threading.Thread(target=work, name=f"kvlearn.parts.check({suite.module.__name__})", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(POLL_S)
            now, since = time.perf_counter(), trace.since
            late = "call" if since is not None and now - since > call_limit_s else "total" if now > deadline else None
            if late and worker.is_alive():
                stop()
                worker.join(GRACE_S)
                return "timeout", late, trace
    except BaseException:   # a real Ctrl-C while waiting: stop the part, and stop the check
        stop()
        raise
    return (*outcome[0], trace)


def _shrink(suite: Suite, impl, setup: dict, ops: list, outcome: tuple, clock: _Clock, max_runs: int = 400):
    """Drop operations while the program still fails the same way (same kind of failure); within
    TOTAL_FLOORS x time_limit_s, and never past a run that timed out (its thread may still run)."""
    ops = ops[:outcome[2].op + 1]   # nothing after the failing operation matters
    i, runs, deadline = len(ops) - 2, 0, time.perf_counter() + TOTAL_FLOORS * clock.floor_s
    while i >= 0 and runs < max_runs:
        shorter = ops[:i] + ops[i + 1:]
        attempt = _run(suite, impl, setup, shorter, clock.call_limit(), deadline)
        runs += 1
        if attempt[0] == "timeout":
            break
        if attempt[0] == outcome[0]:
            ops, outcome = shorter[:attempt[2].op + 1], attempt
            i = min(i, len(ops) - 1)
        i -= 1
    return ops, outcome


def _what(suite: Suite, outcome: tuple) -> str:
    """What a run that failed did, in one line (the reference's run: the checker's bug)."""
    kind, detail, trace = outcome
    last = trace.lines[-1] if trace.lines else "building the part"
    if kind == "broken":
        return f"{detail.what} (after `{last}`)"
    if kind == "timeout":
        return f"`{last}` did not return within {REFERENCE_LIMIT_S:g} s"
    return f"{'`' + last + '` raised' if kind in ('raised', 'stub') else 'the suite raised'} {describe(detail)}"


def _failure(head: str, suite: Suite, index: int, programs: int, ops: list, outcome: tuple, clock: _Clock) -> str:
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
        what = f"It raised {describe(detail)}; the rules say this call succeeds here."
    elif kind == "timeout" and detail == "call":
        what = (f"The last call did not return within {clock.call_limit():.2g} s (the limit per call: "
                f"{clock.floor_s:g} s, or {CALL_FACTOR} times the package's slowest call if longer): an endless "
                "loop? (a while loop whose condition never changes, a walk that never reaches the root or a leaf)")
    elif kind == "timeout":
        what = (f"All programs together took more than {clock.total_limit():.2g} s ({TOTAL_FACTOR} times the "
                f"package's {_label(suite.reference)} on the same programs, at least {TOTAL_FLOORS * clock.floor_s:g}"
                " s): far slower than the chapter's code, or an endless loop outside the part's calls?")
    else:
        what = (f"The checker could not use what the part returned ({describe(detail)}): "
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


class _Snapshot:
    """The checker's modules as imported: their globals (a dict's items too) and the members of the
    classes they define. `restore()` puts back what was replaced, removes what was added, and
    names both ("module.name")."""

    def __init__(self):
        self.spaces = []   # (owner, its namespace as imported, the dicts among its values as imported)

    def take(self, modules: list[ModuleType]) -> None:
        for module in modules:
            self.spaces.append((module, dict(vars(module)), {}))
            for value in vars(module).values():
                if isinstance(value, type) and value.__module__ == module.__name__:
                    self.spaces.append((value, dict(vars(value)), {}))
        for _, names, dicts in self.spaces:
            dicts.update((key, dict(value)) for key, value in names.items() if isinstance(value, dict))

    def restore(self) -> list[str]:
        changed = []
        for owner, names, dicts in self.spaces:
            now = vars(owner)
            for key in [key for key in now if key not in names and not key.startswith("__")]:
                delattr(owner, key)
                changed.append(f"{owner.__name__}.{key} (added)")
            for key, value in names.items():
                if key.startswith("__"):
                    continue
                if now.get(key, _MISSING) is not value:
                    setattr(owner, key, value)
                    changed.append(f"{owner.__name__}.{key}")
                elif key in dicts and (value.keys() != dicts[key].keys()
                                       or any(value[k] is not v for k, v in dicts[key].items())):
                    value.clear()
                    value.update(dicts[key])
                    changed.append(f"{owner.__name__}.{key} (its items)")
        return changed


_MISSING = object()


def _checker(snapshot: _Snapshot):
    """`check`, holding the snapshot of the checker's modules in its closure (not in a global a part
    could replace); `kvlearn.parts.check` is checked too."""

    def check(name: str, impl, time_limit_s: float = 2.0, programs: int = 300, seed: int = 0) -> CheckReport:
        """Run the conformance suite of part `name` (a key of `SUITES`: "block_table", "block_manager", ...)
        on `impl`, the part's class (built with the same arguments as the package's) or, for "attention",
        its function, over `programs` random programs drawn from `seed`. `time_limit_s`: the least time
        one call may take before it counts as an endless loop (more when the package's own part is slow
        on this machine: the module docstring says how much). Never raises because of the part; ValueError
        or TypeError for an unknown `name`, `programs` < 1 or not an int, a time limit that is not a
        finite number > 0."""
        return _check(name, impl, time_limit_s, programs, seed, restore, restore())

    def restore() -> list[str]:
        changed, package = snapshot.restore(), sys.modules["kvlearn.parts"]
        if getattr(package, "check", check) is not check:
            package.check = check
            changed.append("kvlearn.parts.check")
        return changed

    return check


# The last lines: the snapshot of the checker as imported, this module's `check` included.
check = _checker(_snapshot := _Snapshot())
_snapshot.take([sys.modules[__name__], trace_module, references, suite_block_manager, suite_block_table,
                suite_radix_cache, suite_allocator, suite_attention, suite_scheduler])
