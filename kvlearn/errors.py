"""The one kvlearn exception class of its own: running out of KV memory."""


class KVCapacityError(RuntimeError):
    """Not enough free KV slots or blocks for what was asked; nothing was allocated."""
