"""Chapter 6's way in for the KV managers of later chapters: a registry of factories.

The engine asks each registered factory, in order, for its KV manager; the first that returns one
wins, and with none the engine takes one of its own cache modes (`kvlearn.serving.cache_modes`).
A factory is `factory(options, pool, model) -> KVManager | None`: `options` is the engine's
`EngineConfig` (cache, host_slots, disk_dir, write_policy, disk_max_bytes, max_requests, ...),
`pool` is its KV pool and `model` its model; it returns None when the options do not ask for its
kind of manager. `kvlearn/__init__` registers chapter 8's tiers (`kvlearn.tiers.make_tiered_kv`),
so the engine never imports a later chapter. This module imports nothing: registering is free.
"""

_FACTORIES: list = []


def register_kv_factory(factory) -> None:
    """Add `factory` to the ones the engine asks (once: registering it again changes nothing)."""
    if not callable(factory):
        raise TypeError(f"a KV factory is callable(options, pool, model), got {type(factory).__name__}.")
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)


def registered_kv(options, pool, model):
    """The KV manager of the first registered factory that returns one, or None."""
    for factory in _FACTORIES:
        kv = factory(options, pool, model)
        if kv is not None:
            return kv
    return None
