"""kvlearn's own exception class, and the checks of sizes and names that every entry point shares.

Every check raises TypeError for a value of the wrong type (bools are never sizes or ids) and
ValueError for a value out of range, naming the argument and what to give instead.

Fault points: a step of the bookkeeping that a test may make fail calls `fault_point(name)` first.
It does nothing unless a test armed a hook (`set_fault_hook`, see tests/faults.py), which gets the
name and may raise, as an error or a Ctrl-C at that point would. Public methods are injected as
they are; the fault points name the inner steps, so that no test depends on a private name.
"""

from collections.abc import Callable

_fault_hook: Callable[[str], None] | None = None


class KVCapacityError(RuntimeError):
    """Not enough free KV slots or blocks for what was asked; nothing was allocated."""


class PartError(RuntimeError):
    """A learner's part (kvlearn.parts) gave the engine an answer that breaks its contract; the
    engine checked it before using it, did not use it, and aborted the requests of the step.
    `part` is the part's name ("radix_cache", "allocator", ...), `call` the call that answered;
    `impl` the part (its class or function names it) or a label."""

    def __init__(self, part: str, impl, call: str, returned: str, contract: str):
        self.part, self.call = part, call
        label = impl if isinstance(impl, str) else getattr(impl, "__qualname__", None) or type(impl).__name__
        super().__init__(f"parts[{part!r}] ({label}) broke its contract in {call}: it returned {returned}, but "
                         f"{contract}. The engine did not use that answer; fix the part (kvlearn.parts.check("
                         f"{part!r}, {label}) tries many programs, but not every one).")


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


def check_bool(name: str, value, what: str = "") -> bool:
    """Return `value` if it is True or False (not a string, None or a number); else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False{what}, got {type(value).__name__} {value!r}: pass "
                        f"{name}=True or {name}=False.")
    return value


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
