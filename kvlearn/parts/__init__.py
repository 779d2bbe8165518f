"""Parts: the learner's code inside the engine.

A part is a class (for "attention", a function) with the contract of the package's own, built with the same arguments:

| name            | the package's                            | contract         | base for untaught bookkeeping |
|-----------------|------------------------------------------|------------------|-------------------------------|
| "block_table"   | kvlearn.BlockManager, no caching (ch. 1) | BlockTablePart   | BlockManagerBase              |
| "block_manager" | kvlearn.BlockManager (ch. 1-2)           | BlockManagerPart | BlockManagerBase              |
| "radix_cache"   | kvlearn.RadixCache (ch. 3)               | RadixCachePart   | RadixCacheBase                |
| "allocator"     | kvlearn.allocator.PageAllocator (ch. 4)  | AllocatorPart    | AllocatorBase                 |
| "attention"     | kvlearn.attention.paged_attention (ch. 5)| AttentionPart    | (none: a function)            |
| "scheduler"     | kvlearn.serving.scheduler.Scheduler (ch. 6) | SchedulerPart | SchedulerBase         |

`Engine(model, tok, cache="radix", parts={"radix_cache": MyRadixCache, "allocator": MyAllocator})`
serves with them (missing parts are the package's); `check("radix_cache", MyRadixCache)` runs the
conformance suite and returns a `CheckReport` (`.passed`, `.message`). A part never needs to
inherit from the package's finished class; the bases hold only what the chapter does not teach.
"block_table" is checked and drawn (chapter 1) but serves no engine: the engine's block manager is
"block_manager", which chapter 2 grows from it. Both are built like `kvlearn.BlockManager`, the
block table with `enable_prefix_caching=False`.
"""

from kvlearn.parts.allocator import AllocatorBase, AllocatorPart
from kvlearn.parts.attention import AttentionPart
from kvlearn.parts.block_manager import BlockManagerBase, BlockManagerPart, BlockTablePart
from kvlearn.parts.conformance import SUITES, CheckReport, check
from kvlearn.parts.radix_cache import RadixCacheBase, RadixCachePart, RadixNode
from kvlearn.parts.scheduler import SchedulerBase, SchedulerPart

# Each part's name -> the package's own class (for "attention", function) of that name (what a missing
# part is; "block_table" is BlockManager built with enable_prefix_caching=False).
PARTS = {name: suite.reference for name, suite in SUITES.items()}

__all__ = ["PARTS", "check", "CheckReport", "AllocatorPart", "AllocatorBase", "AttentionPart", "BlockTablePart",
           "BlockManagerPart", "BlockManagerBase", "RadixCachePart", "RadixCacheBase", "RadixNode",
           "SchedulerPart", "SchedulerBase"]
