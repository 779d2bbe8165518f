"""Chapter 8: the tiered cache mode, chapter 6's radix mode over a device pool with tiers below.

`TieredRadixKV` is `RadixKV` (kvlearn.serving.cache_modes) with a `TieredRadixCache` as its tree:
the scheduler sees the same contract. What changes: eviction demotes instead of dropping, and
admission loads the matched off-device nodes and disk pages back into the request's fresh slots
before the forward that reads them, so they count as cached, not computed.

Invariant (`check`, after every step): chapter 6's slot conservation on the device, and on the host
free slots + slots held by tree nodes == host pool size.

The engine never imports this chapter: `make_tiered_kv` is its way in, a factory that
`kvlearn/__init__` registers with chapter 6's `register_kv_factory`.
"""

from __future__ import annotations

from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import RadixKV
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.request import Request
from kvlearn.tiers.disk import MISS_REASONS, DiskStore, model_identity
from kvlearn.tiers.host import host_pool_for
from kvlearn.tiers.tree import TieredRadixCache

DISK_PAGE_TOKENS = 16  # tokens per disk file (rounded up to whole device pages)


class TieredRadixKV(RadixKV):
    """Radix mode with a host pool and/or a disk store below the device pool."""

    name = "radix"

    def __init__(self, pool: KVPool, max_requests: int = DEFAULT_MAX_REQUESTS, host: KVPool | None = None,
                 disk: DiskStore | None = None, write_policy: str = "write_back"):
        super().__init__(pool, max_requests)
        self.tree = TieredRadixCache(pool, host, disk, write_policy)

    def counters(self) -> dict:
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

    def admit(self, req: Request) -> int | None:
        # Chapter 6's radix admission gives the row the match's device part, then fresh slots for
        # the rest, and locks the match. Load what lies below the device into them before any
        # forward reads the row.
        if super().admit(req) is None:
            return None
        h = req.kv
        row = self.rows.req_to_token[h.row, :h.num_slots]
        try:
            h.prefix_len, h.last_node = self.tree.load_back(req.token_ids[:-1], h.last_node, row)
        except BaseException:
            # Undo the admission. The tree keeps the slots it adopted (nodes brought back before the
            # failure) and `last_node` still holds the lock: `release` (nothing computed yet) hands
            # back the lock, the request's other slots and its row.
            h.prefix_len = self.tree.device_head(req.token_ids[:-1], row)
            self.release(req)
            raise
        return h.prefix_len

    def cache_request(self, req: Request, n: int, keep_locked: bool) -> None:
        try:
            super().cache_request(req, n, keep_locked)
        except BaseException:
            # write_through copies after the insert itself: if a copy failed, the tree already owns
            # the request's slots it took. They are no longer the request's to free; running
            # `cache_request` again (release does) finishes the job.
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


def make_tiered_kv(options, pool: KVPool, model) -> TieredRadixKV | None:
    """The tiered radix mode for an engine whose options ask for a host pool (`host_slots`) or a disk
    folder (`disk_dir`), else None; chapter 6 checked the plain options (`write_policy`, radix only,
    sizes). options: the engine's (cache, host_slots, disk_dir, write_policy, disk_max_bytes,
    max_requests). disk_max_bytes: the disk tier's capacity (least recently used pages go first),
    None: no limit."""
    if options.host_slots is None and options.disk_dir is None:
        return None
    disk = None
    if options.disk_dir is not None:  # first: it checks the folder before the host pool takes memory
        page = -(-DISK_PAGE_TOKENS // pool.page_size) * pool.page_size
        # A page holds the pool's rows as stored (chapter 10: quantized, with their scales); the
        # format joins the identity, so a folder never hands one format's bytes to another.
        kind = "" if pool.kv_cache_dtype == "auto" else f" kv_cache_dtype={pool.kv_cache_dtype}"
        disk = DiskStore(options.disk_dir, model_identity(model) + kind, pool.kv.dtype,
                         (pool.num_layers, pool.num_kv_heads, pool.kv.shape[-1]), page,
                         max_bytes=options.disk_max_bytes)
    host = None if options.host_slots is None else host_pool_for(pool, options.host_slots)
    return TieredRadixKV(pool, options.max_requests, host, disk, options.write_policy)
