"""The KV-manager contract: declared once, implemented by every cache mode, and queries are pure."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from kvlearn.pool import KVPool, ReqToTokenPool
from kvlearn.serving import cache_modes
from kvlearn.serving.cache_modes import CACHE_MODES, make_kv_manager
from kvlearn.serving.kv_manager import KVManager
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler

SERVING = Path(cache_modes.__file__).parent


def used_members() -> set[str]:
    """Every `kv.<member>` the scheduler, the engine and simulate use."""
    text = "".join((SERVING / f).read_text() for f in ("scheduler.py", "engine.py", "simulate.py"))
    return set(re.findall(r"\bkv\.([a-z_]+)", text))


def test_every_member_the_serving_layer_uses_is_declared_and_documented():
    used = used_members()
    assert {"admit", "grow", "release", "cached_len", "check", "kv_indices"} <= used
    for member in sorted(used):
        if member in KVManager.__annotations__:
            continue  # a plain attribute, commented where it is declared
        assert hasattr(KVManager, member), f"the serving layer uses kv.{member}, which the contract does not declare"
        doc = inspect.getdoc(getattr(KVManager, member))
        assert doc and doc.split(":")[0] in ("Query", "Mutation"), f"KVManager.{member} does not say what it is"


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_each_mode_implements_the_whole_contract(cache):
    kv = make_kv_manager(cache, KVPool(1, 1, 1, 64, page_size=4))
    assert isinstance(kv, KVManager) and kv.name == cache
    assert not getattr(type(kv), "__abstractmethods__", None)
    assert isinstance(kv.rows, ReqToTokenPool)  # chapter 4's table is the engine's slot table


def fill(cache, page_size=1):
    pool = KVPool(1, 1, 1, 256, page_size=page_size)
    scheduler = Scheduler(make_kv_manager(cache, pool), schedule="lpm")
    for rid, prompt in enumerate([list(range(1, 40)), list(range(1, 20)) + [99] * 8]):
        scheduler.add(Request(rid, prompt, 3, page_size))
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [7] * len(batch))
    return scheduler


def radix_state(tree):
    return tree.clock, [(n.id, n.key, n.last_access, n.lock_ref, n.value.tolist()) for n in tree.nodes()]


@pytest.mark.parametrize("cache, page_size", [("radix", 1), ("radix", 4), ("blocks", 4)])
def test_lpm_ordering_is_a_pure_query(cache, page_size):
    scheduler = fill(cache, page_size)
    kv = scheduler.kv
    waiting = [list(range(1, 30)) + [5], list(range(1, 12)), list(range(1, 20)) + [99] * 5]
    for rid, prompt in enumerate(waiting, start=10):
        scheduler.add(Request(rid, prompt, 3, page_size))
    before = radix_state(kv.cache) if cache == "radix" else (dict(kv.manager.hash_to_block_id),
                                                              kv.manager.free_block_ids, repr(kv.manager.stats))
    order = [(req.rid, cached) for req, cached in scheduler.queue_order()]
    after = radix_state(kv.cache) if cache == "radix" else (dict(kv.manager.hash_to_block_id),
                                                             kv.manager.free_block_ids, repr(kv.manager.stats))
    assert after == before  # no split, no clock tick, no LRU move
    cached = {10: 29, 11: 10, 12: 23} if page_size == 1 else {10: 28, 11: 8, 12: 20}
    assert order == sorted(((rid, cached[rid]) for rid in cached), key=lambda pair: -pair[1])
    if cache == "radix":  # the real match agrees with the query, and only then splits and ticks
        assert len(kv.cache.match_prefix(waiting[0][:-1])) == order[0][1]


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_rows_hold_exactly_the_running_requests_and_the_pool_ends_free(cache):
    pool = KVPool(1, 1, 1, 128, page_size=4)
    kv = make_kv_manager(cache, pool, max_requests=3)
    scheduler = Scheduler(kv)
    for rid in range(5):
        scheduler.add(Request(rid, [1, 2, 3, 4, 5, rid + 10], 4, page_size=4))
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert len(scheduler.running) <= 3  # no more requests than rows
        for req, slots in zip(batch.requests, batch.kv_indices, strict=True):
            assert slots.data_ptr() == kv.rows.req_to_token[req.kv.row].data_ptr()  # a view of the row
            assert not pool.is_free(slots).any()
        scheduler.postprocess(batch, [7] * len(batch))
    assert kv.rows.num_free == 3
    kv.evict_all()
    assert pool.num_free == pool.num_slots  # one allocator: the pool's count is the truth in every mode
    assert torch.equal(pool.allocator.is_free(torch.arange(32)), torch.ones(32, dtype=torch.bool))


def _sim_state(sim):
    """What a model-free run leaves behind: scheduler stats and last report, every running request's
    tokens and slots, and the pool's and cache's counts."""
    s, kv = sim.scheduler, sim.kv
    rows = [(r.rid, list(r.token_ids), r.num_computed, kv.rows.req_to_token[r.kv.row, :r.kv.num_slots].tolist())
            for r in s.running]
    return dict(s.stats), s.num_steps, repr(s.report), rows, kv.free_slots, kv.evictable_slots, kv.evicted_tokens


@pytest.mark.parametrize("cache, page_size", [("radix", 1), ("radix", 4), ("none", 1), ("blocks", 4), ("tiered", 1)])
def test_a_decode_stretch_leaves_what_as_many_steps_leave(cache, page_size):
    """`SimEngine.advance(n)` (`fast_forward.run_decode_stretch`) against n `step()` calls, on a
    pool where finished requests' cache must be evicted while the others decode."""
    from kvlearn.serving.simulate import SimEngine
    from kvlearn.tiers.host import host_pool_for
    from kvlearn.tiers.manager import TieredRadixKV

    def engine():
        pool = KVPool(1, 1, 1, 96, page_size=page_size)
        kv = TieredRadixKV(pool, host=host_pool_for(pool, 64)) if cache == "tiered" else make_kv_manager(cache, pool)
        sim = SimEngine(kv, filler=7)
        for rid in range(3):
            sim.add(Request(rid, [rid + 1] * 8 + list(range(20, 28)), 10 + 15 * rid, page_size),
                    answer=tuple(range(100, 105 + rid)))
        return sim

    stretched, stepped = engine(), engine()
    stretches, evicted = [], 0
    while stepped.has_unfinished():
        steps, evicts = stretched.decode_stretch()
        assert (steps, evicts) == stepped.decode_stretch()
        if steps:
            before = stretched.kv.evicted_tokens
            stretched.advance(steps)
            stretches.append(steps)
            evicted += stretched.kv.evicted_tokens - before
            assert evicts == (stretched.kv.evicted_tokens > before)
        else:
            stretched.step()
        for _ in range(steps or 1):
            stepped.step()
        assert _sim_state(stretched) == _sim_state(stepped)
    assert not stretched.has_unfinished()
    if cache == "blocks":   # a decode step publishes the blocks it fills: no stretches
        assert not stretches
    else:
        assert sum(stretches) > 20 and (evicted > 0) == (cache != "none")
