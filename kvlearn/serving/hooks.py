"""Chapter 6's ways in for what the engine never imports, registered by kvlearn/__init__ (this imports nothing):

- KV factories: the engine asks each `factory(options, pool, model) -> KVManager | None` in order
  (its `EngineConfig`, KV pool and model) for its KV manager; the first that returns one wins, else
  the engine takes one of its cache modes (`kvlearn.serving.cache_modes`). Chapter 8's tiers.
- Part guards: a `table()` returns {part name: guard}, asked only when a learner's part is given
  (kvlearn.parts' `GUARDS`); `kvlearn.serving.part_registry.served` says what a guard returns.
- Part records: `records()` returns a later chapter's parts (`PartRecord`s: chapter 10's quantizer),
  read once, when `kvlearn.serving.part_registry` builds its `REGISTRY`.
"""

_FACTORIES, _GUARD_TABLES, _PART_RECORDS = [], [], []   # what each register_* function adds to


def _register(registry: list, hook, what: str) -> None:
    if not callable(hook):
        raise TypeError(f"{what} must be callable, got {type(hook).__name__}.")
    if hook not in registry:   # once: registering it again changes nothing
        registry.append(hook)


def register_kv_factory(factory) -> None:
    """Add `factory(options, pool, model)` to the ones the engine asks."""
    _register(_FACTORIES, factory, "a KV factory (options, pool, model)")


def registered_kv(options, pool, model):
    """The KV manager of the first registered factory that returns one, or None."""
    for factory in _FACTORIES:
        kv = factory(options, pool, model)
        if kv is not None:
            return kv
    return None


def register_part_guards(table) -> None:
    """Add `table() -> {part name: guard(part)}` to the tables of part guards."""
    _register(_GUARD_TABLES, table, "a table of part guards ()")


def part_guard(name: str):
    """The guard of the first registered table that has one for the part `name`, or None."""
    for table in _GUARD_TABLES:
        guard = table().get(name)
        if guard is not None:
            return guard
    return None


def register_part_records(records) -> None:
    """Add `records() -> [PartRecord, ...]` to the parts of kvlearn.serving.part_registry's `REGISTRY`."""
    _register(_PART_RECORDS, records, "a list of part records ()")


def part_records() -> list:
    """The records of every registered `records()`, in order."""
    return [record for records in _PART_RECORDS for record in records()]
