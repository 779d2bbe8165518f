"""The record of one run of a part: the calls made so far, as code a learner can read, how long the
part took in them, and the ways a run ends early (the part broke a rule, raised, or a call did not
come back in time)."""

from __future__ import annotations

import time

import torch


class Broken(Exception):
    """The part broke a rule: what was expected, what it gave, and a hint in the chapter's words."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


class Raised(Exception):
    """A call of the part raised where the rules say it must not (`error` is what it raised: any
    BaseException, a KeyboardInterrupt raised by the part's own code included)."""

    def __init__(self, error: BaseException):
        super().__init__(type(error).__name__)
        self.error = error


class TimeUp(BaseException):
    """Raised into the thread that runs a program when the part's time is up (a BaseException, so
    that `except Exception` in the part does not swallow it; a call lets it through)."""


class Trace:
    """The calls a program made to the part, one line each (`lines`), and how many (`calls`); the
    time spent inside them (`seconds`), the slowest one (`slowest`), and when the call running now
    started (`since`, a `time.perf_counter()`; None between calls), for the thread that waits."""

    def __init__(self):
        self.lines: list[str] = []
        self.calls = 0
        self.op = 0   # the index of the program's operation being run
        self.seconds = self.slowest = 0.0
        self.since: float | None = None

    def note(self, line: str) -> None:
        """A line that is not a call of the part (building an argument, say)."""
        self.lines.append(line)

    def call(self, line: str, fn, *args, quiet: bool = False, **kwargs):
        """Call the part (`line` says how, in code); its exception becomes `Raised`. A `quiet`
        call (a query after every step) joins the story only if it raises."""
        self.lines.append(line)
        try:
            result = self._timed(fn, *args, **kwargs)
        except TimeUp:
            raise
        except BaseException as error:
            raise Raised(error) from error
        if quiet:
            self.lines.pop()
        return result

    def refused(self, line: str, errors: tuple, fn, *args, hint: str) -> None:
        """Call the part where the rules say it must raise one of `errors` (and change nothing)."""
        self.lines.append(line)
        names = " or ".join(e.__name__ for e in errors)
        try:
            self._timed(fn, *args)
        except NotImplementedError as error:   # a stub: "Not yet", whatever the call was
            raise Raised(error) from error
        except errors:
            self.lines[-1] += "  -> raises, as it must"
            return
        except TimeUp:
            raise
        except BaseException as error:
            raise Broken(f"expected {names}, got {describe(error)}", hint) from error
        raise Broken(f"expected {names}, but the call returned", hint)

    def _timed(self, fn, *args, **kwargs):
        """One call of the part, counted and timed."""
        self.calls += 1
        self.since = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - self.since
            self.since = None
            self.seconds += took
            self.slowest = max(self.slowest, took)

    def answer(self, note: str) -> None:
        """Add what the last call returned to its line."""
        self.lines[-1] += f"  -> {note}"


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
