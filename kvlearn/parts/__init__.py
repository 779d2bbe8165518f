"""Parts: the learner's code inside the engine.

A part is a class (for "attention", a function; for "decode_kernel", a Triton kernel: chapter 5's
exercise 3, served with `attention_backend="triton"`) with the contract of the package's own, built with
the same arguments; the table at the end lists them (from the registry of parts,
kvlearn.serving.part_registry). `check("radix_cache", MyRadixCache)` runs the part's conformance
suite and returns a `CheckReport` (`.passed`, `.message`); `Engine(model, tok, cache="radix",
parts={"radix_cache": MyRadixCache, "allocator": MyAllocator})` serves with them (missing parts are
the package's), behind thin checks (`kvlearn.parts.guard`). A part never needs to inherit from the
package's finished class; the bases (which the package's parts inherit too) hold only what the
chapter does not teach. "block_table" is checked and drawn (chapter 1) but serves no engine: the
engine's block manager is "block_manager", which chapter 2 grows from it (both are built like
`kvlearn.BlockManager`, the block table with `enable_prefix_caching=False`).

"""

from kvlearn.parts.allocator import AllocatorBase, AllocatorPart
from kvlearn.parts.attention import AttentionPart
from kvlearn.parts.block_manager import BlockManagerBase, BlockManagerPart, BlockTablePart
from kvlearn.parts.conformance import SUITES, CheckReport, check
from kvlearn.parts.decode_kernel import DecodeKernelPart
from kvlearn.parts.quantizer import QuantizerPart
from kvlearn.parts.radix_cache import RadixCacheBase, RadixCachePart, RadixNode
from kvlearn.parts.scheduler import SchedulerBase, SchedulerPart

# Each part's name -> the package's own part: what a missing part is.
PARTS = {name: suite.package for name, suite in SUITES.items()}


def _docs_table() -> str:
    """The end of this package's docstring: a markdown table of the parts, in the registry's order."""
    rows = [("name", "the package's", "taught in", "contract", "base for untaught bookkeeping")]
    for name, suite in SUITES.items():
        package = suite.package   # its base, when a learner may inherit it too (one of this package's)
        bases = [base.__name__ for base in getattr(package, "__bases__", ()) if base.__name__ in __all__]
        rows.append((f'"{name}"', f"{package.__module__}.{package.__qualname__}", suite.record.taught,
                     suite.contract.__name__, bases[0] if bases else "(none)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rows.insert(1, tuple("-" * width for width in widths))
    return "\n".join("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |"
                     for row in rows)


__all__ = ["PARTS", "check", "CheckReport", "AllocatorPart", "AllocatorBase", "AttentionPart", "DecodeKernelPart",
           "BlockTablePart", "BlockManagerPart", "BlockManagerBase", "RadixCachePart", "RadixCacheBase", "RadixNode",
           "SchedulerPart", "SchedulerBase", "QuantizerPart"]

if __doc__ is not None:   # python -OO drops docstrings
    __doc__ += _docs_table() + "\n"
