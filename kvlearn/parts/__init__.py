"""Parts: the learner's code inside the engine.

A part is a class with the contract of the package's own, built with the same arguments:

| name            | the package's                      | contract           | base for untaught bookkeeping |
|-----------------|------------------------------------|--------------------|-------------------------------|
| "block_manager" | kvlearn.BlockManager (ch. 1-2)     | BlockManagerPart   | BlockManagerBase              |
| "radix_cache"   | kvlearn.RadixCache (ch. 3)         | RadixCachePart     | RadixCacheBase                |
| "allocator"     | kvlearn.allocator.PageAllocator (ch. 4) | AllocatorPart | AllocatorBase                 |
| "scheduler"     | kvlearn.serving.scheduler.Scheduler (ch. 6) | SchedulerPart | SchedulerBase             |

`Engine(model, tok, cache="radix", parts={"radix_cache": MyRadixCache, "allocator": MyAllocator})`
serves with them (missing parts are the package's); `check("radix_cache", MyRadixCache)` runs the
conformance suite and returns a `CheckReport` (`.passed`, `.message`). A part never needs to
inherit from the package's finished class; the bases hold only what the chapter does not teach.
"""

from kvlearn.allocator import PageAllocator
from kvlearn.blocks import BlockManager
from kvlearn.parts.allocator import AllocatorBase, AllocatorPart
from kvlearn.parts.block_manager import BlockManagerBase, BlockManagerPart
from kvlearn.parts.conformance import CheckReport, check
from kvlearn.parts.radix_cache import RadixCacheBase, RadixCachePart, RadixNode
from kvlearn.parts.scheduler import SchedulerBase, SchedulerPart
from kvlearn.radix import RadixCache
from kvlearn.serving.scheduler import Scheduler

# Each part's name -> the package's own class of that name (what a missing part is).
PARTS = {"block_manager": BlockManager, "radix_cache": RadixCache, "allocator": PageAllocator,
         "scheduler": Scheduler}

__all__ = ["PARTS", "check", "CheckReport", "AllocatorPart", "AllocatorBase", "BlockManagerPart",
           "BlockManagerBase", "RadixCachePart", "RadixCacheBase", "RadixNode",
           "SchedulerPart", "SchedulerBase"]
