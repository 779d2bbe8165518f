"""Checkers for the exercises at the end of each chapter: `from kvlearn.exercises import ch00`.

A checker does not raise on the stubs of the student copies (a function that returns None, or `...`
as the answer) nor when the learner's function raises: both get "Not yet: <hint>" and False. A
hint shows the inputs of the call it is about, whether the function answered wrongly or raised, and
each likely mistake of an exercise gets a hint of its own (tests/test_exercise_hints.py lists them)."""

OK, NOT_YET = "OK, well done.", "Not yet:"  # the verdicts, as the course runner counts them


def report(ok: bool, hint: str) -> bool:
    """Print a friendly verdict and return it, so a checker works in a notebook cell and in a test."""
    print(OK if ok else f"{NOT_YET} {hint}")
    return ok


def given(**inputs) -> str:
    """The inputs of a call as a hint shows them: "block_table=[2, 3, 4], block_size=4, slot=8"."""
    return ", ".join(f"{name}={value!r}" for name, value in inputs.items())


def attempt(fn, *args, shown: str):
    """(fn(*args), None), or (None, what went wrong) if the learner's function raised; `shown` names
    the inputs (`given(...)`, or words for inputs too long to print), as a wrong answer's hint does."""
    try:
        return fn(*args), None
    except Exception as e:  # a learner's function may fail in any way; say how, don't crash
        return None, f"{shown}: your function raised {type(e).__name__}: {e}"


def likely_mistake(got, mistakes) -> str | None:
    """The hint of the first (answer, hint) in `mistakes` whose answer is `got`, or None. Each checker
    lists the answers its likely mistakes give on the inputs at hand, so each gets its own hint."""
    return next((hint for answer, hint in mistakes if _same(got, answer)), None)


def _same(got, answer) -> bool:
    try:
        return bool(got == answer)
    except Exception:   # a tensor of another shape, or an object whose == raises: not that mistake
        return False
