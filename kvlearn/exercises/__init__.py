"""Checkers for the exercises at the end of each chapter: `from kvlearn.exercises import ch00`.

A checker never raises on a learner's answer: a stub (a function that returns None, or `...`), a
wrong type or a function that crashes all get "Not yet: <hint>" and False."""

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
