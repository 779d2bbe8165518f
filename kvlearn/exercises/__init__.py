"""Checkers for the exercises at the end of each chapter: `from kvlearn.exercises import ch00`.

A checker does not raise on the stubs of the student copies (a function that returns None, or `...`
as the answer) nor when the learner's function raises: both get "Not yet: <hint>" and False."""

OK, NOT_YET = "OK, well done.", "Not yet:"  # the verdicts, as the course runner counts them


def report(ok: bool, hint: str) -> bool:
    """Print a friendly verdict and return it, so a checker works in a notebook cell and in a test."""
    print(OK if ok else f"{NOT_YET} {hint}")
    return ok


def attempt(fn, *args):
    """(fn(*args), None), or (None, what went wrong) if the learner's function raised."""
    try:
        return fn(*args), None
    except Exception as e:  # a learner's function may fail in any way; say how, don't crash
        return None, f"your function raised {type(e).__name__}: {e}"
