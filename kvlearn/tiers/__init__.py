"""Chapter 8: KV below the device pool. A host tier (`host`), a disk tier (`disk`), the radix tree
that knows where each node's KV lives (`tree`), and the engine's tiered cache mode (`manager`)."""

from kvlearn.tiers.disk import DiskStore
from kvlearn.tiers.manager import TieredRadixKV, make_tiered_kv
from kvlearn.tiers.tree import TieredRadixCache

__all__ = ["DiskStore", "TieredRadixCache", "TieredRadixKV", "make_tiered_kv"]
