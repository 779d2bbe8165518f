"""The verdict helpers of `check`: `Trace` (a program's calls of the part, as code a learner can
read), the ways a run ends early (`Broken`: a rule broken, with its hint; `Raised`; `TimeUp`) and
the suites' comparisons (`same`, `ints`, `number`); `shown`, a part's answer in a few words (also
for the serving guard's messages).

The time limit is the standard library's: `signal.setitimer` raises `TimeUp` in a call of the part
that runs past `limit_s` (and every 0.1 s after, should the part swallow it). It works in the main
thread (a notebook, a script, pytest) on Linux and macOS; elsewhere calls have no limit. A real
Ctrl-C always goes on up: it stops the check.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import torch


class Broken(Exception):
    """The part broke a rule: what was expected, what it gave, and the rule's hint in the chapter's words."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


class Raised(Exception):
    """A call of the part raised where the rules say it must not (`error`: what it raised)."""

    def __init__(self, error: BaseException):
        super().__init__(type(error).__name__)
        self.error = error


class TimeUp(BaseException):
    """A call of the part ran past its limit (a BaseException: a part's `except Exception` lets it through)."""


@contextmanager
def time_limit(seconds: float | None):
    """Raise `TimeUp` in this block once it has run `seconds` (where signals can: see the module)."""
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeUp

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Trace:
    """A program's calls of the part, one line each (`lines`), how many (`calls`), the time inside
    them (`seconds`), the operation being run (`op`) and the method called last (`method`)."""

    def __init__(self, limit_s: float | None = None):
        self.limit_s = limit_s
        self.lines: list[str] = []
        self.calls, self.op, self.seconds, self.method = 0, 0, 0.0, ""

    def note(self, line: str) -> None:
        """A line that is not a call of the part (building an argument, say)."""
        self.lines.append(line)

    def call(self, line: str, fn, *args, quiet: bool = False, **kwargs):
        """Call the part (`line` says how, in code); what it raises becomes `Raised`. A `quiet`
        call (a query after every step) joins the story only if it raises."""
        self.lines.append(line)
        result = self._timed(fn, *args, **kwargs)
        if quiet:
            self.lines.pop()
        return result

    def refused(self, line: str, errors: tuple, fn, *args, hint: str) -> None:
        """Call the part where the rules say it must raise one of `errors` (and change nothing)."""
        self.lines.append(line)
        names = " or ".join(e.__name__ for e in errors)
        try:
            self._timed(fn, *args)
        except Raised as raised:
            if isinstance(raised.error, NotImplementedError):   # a stub: "Not yet", whatever the call was
                raise
            if not isinstance(raised.error, errors):
                raise Broken(f"expected {names}, got {describe(raised.error)}", hint) from raised.error
            self.lines[-1] += "  -> raises, as it must"
            return
        raise Broken(f"expected {names}, but the call returned", hint)

    def _timed(self, fn, *args, **kwargs):
        """One call of the part, counted, timed and limited."""
        self.calls += 1
        self.method = getattr(fn, "__name__", "")
        start = time.perf_counter()
        try:
            with time_limit(self.limit_s):
                return fn(*args, **kwargs)
        except (TimeUp, KeyboardInterrupt):
            raise
        except BaseException as error:
            raise Raised(error) from error
        finally:
            self.seconds += time.perf_counter() - start

    def answer(self, note: str) -> None:
        """Add what the last call returned to its line."""
        self.lines[-1] += f"  -> {note}"


def shown(value, edge: int = 8) -> str:
    """A short picture of a part's answer (a long list: its ends)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.is_floating_point():
            return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        items = list(value)
        inner = items if len(items) <= 2 * edge else items[:edge] + ["..."] + items[-edge:]
        return f"[{', '.join(map(str, inner))}] ({len(items)} items)"
    return f"{type(value).__name__} {value!r}"[:200]


def describe(error: BaseException) -> str:
    """`Name: message` of an exception, even one whose `str()` fails."""
    try:
        text = str(error)
    except Exception:   # a part's own exception class may break anywhere
        text = "(its message could not be read)"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def same(what: str, expected, got, hint: str) -> None:
    """`Broken` unless `got == expected`."""
    if got != expected:
        raise Broken(f"{what}: expected {expected!r}, got {got!r}", hint)


def ints(what: str, got, hint: str = "") -> list[int]:
    """The ids in `got`, a 1-D int64 tensor; `Broken` when it is something else."""
    if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.dtype != torch.int64:
        shape = f"a {got.dim()}-D {got.dtype} tensor" if isinstance(got, torch.Tensor) else type(got).__name__
        raise Broken(f"{what} must be a 1-D int64 tensor, got {shape}",
                     hint or "return ids as torch.tensor(ids, dtype=torch.int64)")
    return got.tolist()


def number(what: str, got, hint: str = "") -> int:
    """`got` if it is an int (not a bool); `Broken` otherwise."""
    if isinstance(got, bool) or not isinstance(got, int):
        raise Broken(f"{what} must be an int, got {type(got).__name__} {got!r}", hint or "return an int")
    return got
