"""Chapter 6: the registry of parts, the one list every list of parts is read from.

A part is what a chapter's build exercise writes and the engine can serve in place of its own
(kvlearn.parts). Read from `REGISTRY`, in its order: the cache modes each part serves
(`kvlearn.serving.config.PART_MODES`), the conformance suites (`kvlearn.parts.SUITES`: each part's
suite module `kvlearn.parts.suite_NAME` names its contract, the package's own part and what judges
it), the package's parts (`kvlearn.parts.PARTS`, and the table in that package's docstring) and the
build exercises (`kvlearn.exercises.parts.BUILD`). A seventh part is one line here, and its suite.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlearn.serving.cache_modes import CACHE_MODES


@dataclass(frozen=True)
class PartRecord:
    """One part. `name`: its key in `Engine(parts=...)`, `check(name, ...)` and `%%part name`;
    `chapters`: the chapters that teach it, the last one's build exercise writes it; `exercise`: the
    class (for "attention", the function) that exercise defines; `modes`: the cache modes an engine
    serves it in (none: checked and drawn, never served)."""

    name: str
    chapters: tuple[int, ...]
    exercise: str
    modes: tuple[str, ...]

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
    PartRecord("block_table", (1,), "MyBlockTable", ()),
    PartRecord("block_manager", (1, 2), "MyBlockManager", ("blocks",)),
    PartRecord("radix_cache", (3,), "MyRadixCache", ("radix",)),
    PartRecord("allocator", (4,), "MyAllocator", CACHE_MODES),
    PartRecord("attention", (5,), "my_paged_attention", CACHE_MODES),
    PartRecord("scheduler", (6,), "MyScheduler", CACHE_MODES),
)
