"""The record of one run of a part: the calls made so far, as code a learner can read, and the
ways a run ends early (the part broke a rule, raised, or a call did not come back in time)."""

from __future__ import annotations

import torch


class Broken(Exception):
    """The part broke a rule: what was expected, what it gave, and a hint in the chapter's words."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


class Raised(Exception):
    """A call of the part raised where the rules say it must not (`error` is what it raised)."""

    def __init__(self, error: BaseException):
        super().__init__(repr(error))
        self.error = error


class Trace:
    """The calls a program made to the part, one line each (`lines`), and how many (`calls`)."""

    def __init__(self):
        self.lines: list[str] = []
        self.calls = 0
        self.op = 0   # the index of the program's operation being run

    def note(self, line: str) -> None:
        """A line that is not a call of the part (building an argument, say)."""
        self.lines.append(line)

    def call(self, line: str, fn, *args, quiet: bool = False, **kwargs):
        """Call the part (`line` says how, in code); its exception becomes `Raised`. A `quiet`
        call (a query after every step) joins the story only if it raises."""
        self.lines.append(line)
        self.calls += 1
        try:
            result = fn(*args, **kwargs)
        except (Exception, SystemExit) as error:
            raise Raised(error) from error
        if quiet:
            self.lines.pop()
        return result

    def refused(self, line: str, errors: tuple, fn, *args, hint: str) -> None:
        """Call the part where the rules say it must raise one of `errors` (and change nothing)."""
        self.lines.append(line)
        self.calls += 1
        names = " or ".join(e.__name__ for e in errors)
        try:
            fn(*args)
        except NotImplementedError as error:   # a stub: "Not yet", whatever the call was
            raise Raised(error) from error
        except errors:
            self.lines[-1] += "  -> raises, as it must"
            return
        except (Exception, SystemExit) as error:
            raise Broken(f"expected {names}, got {type(error).__name__}: {error}", hint) from error
        raise Broken(f"expected {names}, but the call returned", hint)

    def answer(self, note: str) -> None:
        """Add what the last call returned to its line."""
        self.lines[-1] += f"  -> {note}"


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
