"""Chapter 8: KV below the device pool. A host tier (`host`), a disk tier (`disk`), the radix tree
that knows where each node's KV lives (`tree`), and the engine's tiered cache mode (`manager`)."""

from kvlearn.tiers.disk import DiskStore
from kvlearn.tiers.manager import TieredRadixKV, check_tier_options, make_tiered_kv, tier_counters
from kvlearn.tiers.tree import TIER_STATS, WRITE_POLICIES, TieredRadixCache

__all__ = ["DiskStore", "TIER_STATS", "TieredRadixCache", "TieredRadixKV", "WRITE_POLICIES",
           "check_tier_options", "make_tiered_kv", "tier_counters"]
