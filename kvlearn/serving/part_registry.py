"""Chapter 6: the registry of parts, the one list every list of parts is read from.

A part is what a chapter's build exercise writes and the engine can serve in place of its own
(kvlearn.parts). Read from `REGISTRY`, in its order: the cache modes each part serves
(`kvlearn.serving.config.PART_MODES`), the conformance suites (`kvlearn.parts.SUITES`), the package's
parts (`kvlearn.parts.PARTS`) and the build exercises (`kvlearn.exercises.parts.BUILD`). A part is one
line here and its suite, `kvlearn.parts.suite_NAME`; a later chapter's comes through chapter 6's hooks
(`register_part_records`: chapter 10's "quantizer").

`served(parts, name)` says what the engine serves as a part: the package's own as it is, a learner's
only behind the guard kvlearn.parts registers for it (chapter 6's hooks, `kvlearn.serving.hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlearn.allocator import PageAllocator
from kvlearn.attention import paged_attention
from kvlearn.blocks import BlockManager
from kvlearn.kernels import DECODE_KERNEL
from kvlearn.radix import RadixCache
from kvlearn.serving.cache_modes import CACHE_MODES
from kvlearn.serving.hooks import part_guard, part_records
from kvlearn.serving.scheduler import Scheduler


@dataclass(frozen=True)
class PartRecord:
    """One part. `name`: its key in `Engine(parts=...)`, `check(name, ...)` and `%%part name`;
    `chapters`: the chapters that teach it, the last one's build exercise writes it; `exercise`: the
    class (for "attention", the function) that exercise defines; `modes`: the cache modes an engine
    serves it in (none: checked and drawn, never served); `package`: the package's own part."""

    name: str
    chapters: tuple[int, ...]
    exercise: str
    modes: tuple[str, ...]
    package: object

    @property
    def chapter(self) -> int:
        """The chapter whose build exercise writes the part."""
        return self.chapters[-1]

    @property
    def taught(self) -> str:
        """Where the part is taught, in words: "chapter 3", "chapters 1-2"."""
        first = self.chapters[0]
        return f"chapter {first}" if first == self.chapter else f"chapters {first}-{self.chapter}"


REGISTRY = (
    PartRecord("block_table", (1,), "MyBlockTable", (), BlockManager),   # built with enable_prefix_caching=False
    PartRecord("block_manager", (1, 2), "MyBlockManager", ("blocks",), BlockManager),
    PartRecord("radix_cache", (3,), "MyRadixCache", ("radix",), RadixCache),
    PartRecord("allocator", (4,), "MyAllocator", CACHE_MODES, PageAllocator),
    PartRecord("attention", (5,), "my_paged_attention", CACHE_MODES, paged_attention),
    # Stage 1 of the Triton decode kernel (chapter 5's GPU section); serves with attention_backend="triton".
    PartRecord("decode_kernel", (5,), "my_decode_kernel", CACHE_MODES, DECODE_KERNEL),
    PartRecord("scheduler", (6,), "MyScheduler", CACHE_MODES, Scheduler),
) + tuple(part_records())
RECORDS = {part.name: part for part in REGISTRY}


def served(parts: dict, name: str):
    """What serves as the part `name` of `parts` (the engine's option): None for the package's own
    (not given, or given as the package's), else what its registered guard returns (per part:
    kvlearn.parts.guard); ValueError when none is: a learner's part never serves unguarded."""
    part = parts.get(name)
    if part is None or part is RECORDS[name].package:
        return None
    guard = part_guard(name)
    if guard is None:
        raise ValueError(f"parts[{name!r}] has no guard registered (kvlearn.serving.hooks.register_part_guards), "
                         "and a learner's part serves only behind one: leave it out to serve the package's.")
    return guard(part)
