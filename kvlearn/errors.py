"""kvlearn's own exception class, and the one check of sizes that every entry point shares."""


class KVCapacityError(RuntimeError):
    """Not enough free KV slots or blocks for what was asked; nothing was allocated."""


def check_positive_int(name: str, value, what: str = "") -> int:
    """Return `value` if it is an int >= 1 (bools are not sizes); else TypeError or ValueError
    naming the argument. `what` says what the number counts, e.g. " (tokens per page)"."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{what}, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1{what}, got {value}.")
    return value
