"""kvlearn's own exception class, and the checks of sizes and names that every entry point shares.

Every check raises TypeError for a value of the wrong type (bools are never sizes or ids) and
ValueError for a value out of range, naming the argument and what to give instead.

Fault points: a step of the bookkeeping that a test may make fail calls `fault_point(name)` first.
It does nothing unless a test armed a hook (`set_fault_hook`, see tests/faults.py), which gets the
name and may raise, as an error or a Ctrl-C at that point would. Public methods are injected as
they are; the fault points name the inner steps, so that no test depends on a private name.
"""

from typing import Callable

_fault_hook: Callable[[str], None] | None = None


class KVCapacityError(RuntimeError):
    """Not enough free KV slots or blocks for what was asked; nothing was allocated."""


def check_int(name: str, value, minimum: int = 0, what: str = "") -> int:
    """Return `value` if it is an int >= `minimum` (bools are not ints here); else TypeError or
    ValueError naming the argument. `what` says what the number counts, e.g. " (tokens per page)"."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{what}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{what}, got {value}.")
    return value


def check_positive_int(name: str, value, what: str = "") -> int:
    """`check_int` with minimum 1: sizes and counts."""
    return check_int(name, value, 1, what)


def check_choice(name: str, value, choices) -> str:
    """Return `value` if it is one of `choices`; else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}: choose one of {', '.join(map(repr, choices))}.")
    return value


def fault_point(name: str) -> None:
    """A declared place where a test may inject a fault: calls the armed hook with `name` (it may
    raise); a no-op when none is armed."""
    if _fault_hook is not None:
        _fault_hook(name)


def set_fault_hook(hook: Callable[[str], None] | None) -> None:
    """Arm every fault point with `hook(name)` (for tests), or disarm them with None."""
    global _fault_hook
    _fault_hook = hook
