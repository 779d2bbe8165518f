"""Chapter 8: the tiered cache mode, chapter 6's radix mode over a device pool with tiers below.

`TieredRadixKV` is `RadixKV` (kvlearn.serving.cache_modes) with a `TieredRadixCache` as its tree:
the scheduler sees the same contract. What changes: eviction demotes instead of dropping, and
admission loads the matched off-device nodes and disk pages back into the request's fresh slots
before the forward that reads them, so they count as cached, not computed.

Invariant (`check`, after every step): chapter 6's slot conservation on the device, and on the host
free slots + slots held by tree nodes == host pool size.
"""

from __future__ import annotations

import torch

from kvlearn.errors import check_choice, check_positive_int
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import RadixKV
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.request import Request
from kvlearn.tiers.disk import MISS_REASONS, DiskStore, check_folder, model_identity
from kvlearn.tiers.host import host_pool_for
from kvlearn.tiers.tree import TIER_STATS, WRITE_POLICIES, TieredRadixCache

DISK_PAGE_TOKENS = 16  # tokens per disk file (rounded up to whole device pages)


class TieredRadixKV(RadixKV):
    """Radix mode with a host pool and/or a disk store below the device pool."""

    name = "radix"

    def __init__(self, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS, host: KVPool | None = None,
                 disk: DiskStore | None = None, write_policy: str = "write_back"):
        super().__init__(pool, max_requests)
        self.tree = TieredRadixCache(pool, host, disk, write_policy)

    @property
    def tier_stats(self) -> dict:
        """Cumulative: tokens offloaded and loaded back per tier; with a disk, its pages written and
        evicted, entries refused (damaged, foreign, not a regular file) and OS errors (`disk_errors`,
        and `disk_errors_<kind>` by errno: the disk dropped pages or missed, the engine went on)."""
        stats = dict(self.tree.stats)
        if self.tree.disk is not None:
            disk = self.tree.disk.stats
            stats["disk_pages_written"] = disk["pages_written"]
            stats["disk_pages_evicted"] = disk["pages_evicted"]
            stats["disk_entries_rejected"] = sum(disk[f"miss_{r}"] for r in MISS_REASONS if r != "missing")
            stats.update({f"disk_{k}": v for k, v in disk.items() if k.startswith("errors")})
        return stats

    def flush(self) -> None:
        """Write down what the device and host tiers hold, so that a restart finds it: under
        write_back the disk gets only what leaves memory, so without this a clean exit would leave
        it behind (write_through has written it already). Idempotent; nothing without a disk."""
        self.tree.flush()

    def cached_len(self, token_ids: list[int]) -> int:
        return self.tree.reachable_len(token_ids[:-1])

    def _admit_after(self, req: Request, prefix: torch.Tensor, last_node=None) -> int | None:
        # `prefix` is the match's device part; its slots for the rest come fresh from the pool.
        # Load what lies below the device into them before any forward reads the row.
        if super()._admit_after(req, prefix, last_node) is None:
            return None
        h = req.kv
        row = self.rows.req_to_token[h.row, :h.num_slots]
        try:
            h.prefix_len, h.last_node = self.tree.load_back(req.token_ids[:-1], last_node, row)
        except BaseException:
            # Undo the admission; `admit` then unlocks `last_node`, which still holds the lock. The
            # tree keeps the slots it adopted (nodes brought back before the failure); the
            # request's other slots and its row go back.
            h.prefix_len = self.tree.device_head(req.token_ids[:-1], row)
            self._free_private(req)
            raise
        return h.prefix_len

    def _insert(self, req: Request, n: int, keep_locked: bool) -> None:
        try:
            super()._insert(req, n, keep_locked)
        except BaseException:
            # write_through copies after the insert itself: if a copy failed, the tree already owns
            # the request's slots it took. They are no longer the request's to free; running
            # `_insert` again (release does) finishes the job.
            h = req.kv
            if h is not None:
                row = self.rows.req_to_token[h.row, :h.num_slots]
                h.prefix_len = max(h.prefix_len, self.tree.device_head(req.token_ids, row))
            raise

    def check(self, running: list[Request]) -> None:
        super().check(running)
        host = self.tree.host
        if host is not None:
            assert host.num_free + self.tree.host_size == host.num_slots, (
                f"host slot leak: {host.num_free} free + {self.tree.host_size} held != {host.num_slots}")


def check_tier_options(cache: str, host_slots, disk_dir, write_policy: str, disk_max_bytes=None) -> None:
    """Refuse tier options the engine cannot honour, before anything is built (the disk capacity's
    lower bound, one entry, is checked when the store is built: it depends on the model)."""
    check_choice("write_policy", write_policy, WRITE_POLICIES)
    if host_slots is not None:
        check_positive_int("host_slots", host_slots, " (tokens of KV the host tier holds)")
    if disk_max_bytes is not None:
        check_positive_int("disk_max_bytes", disk_max_bytes, " (bytes the disk tier may use)")
        if disk_dir is None:
            raise ValueError("disk_max_bytes limits the disk tier: give disk_dir too (or leave it None).")
    if (host_slots is not None or disk_dir is not None) and cache != "radix":
        raise ValueError(f"host_slots and disk_dir need cache='radix' (the tiers hang below the radix "
                         f"tree), got cache={cache!r}.")
    if disk_dir is not None:
        check_folder(disk_dir)


def make_tiered_kv(pool: KVPool, model, host_slots: int | None, disk_dir, write_policy: str,
                   max_requests: int = DEFAULT_MAX_REQUESTS, disk_max_bytes: int | None = None) -> TieredRadixKV:
    """The tiered radix mode for an engine's pool and model (options checked by check_tier_options);
    disk_max_bytes: the disk tier's capacity (least recently used pages go first), None: no limit."""
    host = None if host_slots is None else host_pool_for(pool, host_slots)
    disk = None
    if disk_dir is not None:
        page = -(-DISK_PAGE_TOKENS // pool.page_size) * pool.page_size
        disk = DiskStore(disk_dir, model_identity(model), pool.dtype,
                         (pool.num_layers, pool.num_kv_heads, pool.head_dim), page, max_bytes=disk_max_bytes)
    return TieredRadixKV(pool, max_requests, host, disk, write_policy)


def tier_counters(kv) -> dict:
    """The engine's tier stats of a KV manager: cumulative counts, zeros without tiers."""
    return kv.tier_stats if isinstance(kv, TieredRadixKV) else dict.fromkeys(TIER_STATS, 0)
