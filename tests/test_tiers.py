"""Chapter 8's tiers: the disk store's files, the tiered radix mode under the scheduler (with a
stand-in model whose 'KV' is the token and position, so a wrong load changes the output), and the
real model against Hugging Face `generate` under memory pressure and across a restart."""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlearn.pool import KVPool
from kvlearn.radix import RadixCache
from kvlearn.serving.engine import Engine
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler
from kvlearn.serving.workloads import make_workload
from kvlearn.tiers import DiskStore, TieredRadixCache, TieredRadixKV
from kvlearn.tiers.host import host_pool_for
from tests.faults import tiny_model
from tests.hf_reference import hf_greedy
from tests.test_engine import EOS, next_token, reference

SHAPE = (2, 1, 3)  # layers, kv heads, head dim of the disk tests' pages


def page(seed: float, tokens: int = 4) -> torch.Tensor:
    return torch.arange(2 * 2 * tokens * 3, dtype=torch.float32).reshape(2, 2, tokens, 1, 3) + seed


# --- the disk store ----------------------------------------------------------------------------------
def test_a_page_comes_back_and_damaged_or_foreign_files_are_misses(tmp_path):
    store = DiskStore(tmp_path, "model-a", torch.float32, SHAPE, page_tokens=4)
    tokens = [5, 6, 7, 8]
    key = store.entry_keys(tokens + [9])[0]  # full pages only
    store.put(key, tokens, page(1.0))
    assert torch.equal(store.get(key, tokens), page(1.0))
    assert store.get(key, [5, 6, 7, 0]) is None  # same key, other tokens: never their KV
    assert store.get(store.entry_keys([1, 2, 3, 4])[0], [1, 2, 3, 4]) is None
    raw = store.path(key).read_bytes()
    for damaged, reason in ((raw[:-5], "truncated"), (raw[:10], "truncated"),
                            (raw[:-1] + bytes([raw[-1] ^ 1]), "corrupt"), (b"garbage" + raw, "corrupt")):
        store.path(key).write_bytes(damaged)
        before = store.stats[f"miss_{reason}"]
        assert store.get(key, tokens) is None
        assert store.stats[f"miss_{reason}"] == before + 1
    store.path(key).write_bytes(raw)
    for other in (DiskStore(tmp_path, "model-b", torch.float32, SHAPE, page_tokens=4),
                  DiskStore(tmp_path, "model-a", torch.bfloat16, SHAPE, page_tokens=4)):
        assert other.get(key, tokens) is None and other.stats["miss_foreign"] == 1
    assert not list(tmp_path.glob(".tmp-*")), "a temporary file was left behind"


def _write_many(folder, seed, n):
    store = DiskStore(folder, "m", torch.float32, SHAPE, page_tokens=4)
    for _ in range(n):
        store.put(7, [1, 2, 3, 4], page(seed))


@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
def test_two_processes_writing_one_entry_leave_a_valid_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_many, args=(tmp_path, seed, 200)) for seed in (10.0, 20.0)]
    for w in writers:
        w.start()
    store, seen = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4), 0
    while any(w.is_alive() for w in writers):
        kv = store.get(7, [1, 2, 3, 4])
        if kv is not None:  # absent before the first rename, whole after it
            assert torch.equal(kv, page(10.0)) or torch.equal(kv, page(20.0))
            seen += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    kv = store.get(7, [1, 2, 3, 4])
    assert torch.equal(kv, page(10.0)) or torch.equal(kv, page(20.0))
    assert store.stats["miss_truncated"] == store.stats["miss_corrupt"] == 0
    assert [p.name for p in tmp_path.iterdir()] == [store.path(7).name]


def test_an_unusable_folder_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*mkdir"):
        DiskStore(tmp_path / "nope", "m", torch.float32, SHAPE)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        DiskStore(tmp_path / "file", "m", torch.float32, SHAPE)
    with pytest.raises(TypeError, match="folder path"):
        DiskStore(3, "m", torch.float32, SHAPE)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            DiskStore(locked, "m", torch.float32, SHAPE)


# --- the tiered mode under the scheduler, with a stand-in model ------------------------------------
class PoolForward:
    """The stand-in model of test_engine, keeping each token's id and position *in the pool* (K and
    V of a one-number pool), so they travel with the KV through every tier and back."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def __call__(self, batch) -> list[int]:
        out, kv = [], self.pool.kv
        for ids, slots in zip(batch.input_ids, batch.kv_indices, strict=True):
            cached = len(slots) - len(ids)
            positions = kv[0, 1, slots[:cached], 0, 0]
            assert torch.equal(positions, torch.arange(cached, dtype=kv.dtype)), "context read from wrong slots"
            context = kv[0, 0, slots[:cached], 0, 0].long().tolist() + list(ids)
            kv[0, 0, slots[cached:], 0, 0] = torch.tensor(ids, dtype=kv.dtype)
            kv[0, 1, slots[cached:], 0, 0] = torch.arange(cached, len(slots), dtype=kv.dtype)
            out.append(next_token(context))
        return out


def run_tiered(prompts, num_slots, host_slots, disk_dir=None, policy="write_back", max_new=6, rounds=2):
    """Serve the prompts `rounds` times (a returning user) on one tiered manager; check every step."""
    pool = KVPool(1, 1, 1, num_slots)
    disk = DiskStore(disk_dir, "stand-in", torch.float32, (1, 1, 1), 4) if disk_dir else None
    kv = TieredRadixKV(pool, host=host_pool_for(pool, host_slots) if host_slots else None, disk=disk,
                       write_policy=policy)
    scheduler, forward = Scheduler(kv, 64, "fcfs", (EOS,)), PoolForward(pool)
    for r in range(rounds):
        requests = [Request(r * len(prompts) + i, p, max_new) for i, p in enumerate(prompts)]
        for req in requests:
            scheduler.add(req)
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            scheduler.postprocess(batch, forward(batch))  # asserts slot conservation, host included
            kv.tree.check_invariants()
        for req, prompt in zip(requests, prompts, strict=True):
            assert req.output_ids == reference(prompt, max_new)
    return kv, scheduler


PROMPTS = [[1 + i % 3] * 12 + [20 + i] * 6 for i in range(6)]  # three shared heads, six tails


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_pressure_moves_nodes_down_and_back_with_the_right_kv(tmp_path, policy):
    kv, scheduler = run_tiered(PROMPTS, num_slots=48, host_slots=64, policy=policy)
    stats = kv.counters()
    assert stats["offloaded_tokens"] > 0 and stats["loaded_from_host_tokens"] > 0
    kv_none, _ = run_tiered(PROMPTS, num_slots=48, host_slots=None, disk_dir=tmp_path, policy=policy)
    assert kv_none.counters()["loaded_from_disk_tokens"] > 0


def test_host_tier_saves_prefill_over_no_tier():
    from kvlearn.serving.simulate import simulate

    _, tiered = run_tiered(PROMPTS, num_slots=48, host_slots=256)
    plain = simulate(PROMPTS * 2, "radix", max_new_tokens=6, num_slots=48)
    assert tiered.stats["computed_prefill_tokens"] < plain["computed_prefill_tokens"]


# --- chapter 3's eviction policies in the tiered tree ------------------------------------------------
def most_recent_first(node):
    return -node.last_access


@pytest.mark.parametrize("policy, device_order, left_the_host", [
    ("lru", "CAB", "C"), ("lfu", "CBA", "C"), (most_recent_first, "BAC", "B")])
def test_chapter_3s_eviction_policy_orders_the_device_and_the_host(policy, device_order, left_the_host):
    """A (2 hits, last used at t5), B (1 hit, t6), C (no hit, t3), two tokens each. The device moves
    them to a host of room for two, in the policy's order (chapter 3's tree evicts in the same
    order); the third needs room on the host, which drops the smallest key of the two there."""
    keys = {"A": [1, 2], "B": [3, 4], "C": [5, 6]}

    def used(tree, alloc):
        for key in keys.values():
            tree.insert(key, alloc())  # t1, t2, t3
        for name in "AAB":
            tree.match_prefix(keys[name])  # t4, t5, t6

    def name(node):
        return next(n for n, key in keys.items() if tuple(key) == node.key)

    plain_order = []
    plain = RadixCache(eviction_policy=policy, evict_callback=lambda slots: plain_order.append(slots))
    used(plain, iter(torch.arange(6).view(3, 2)).__next__)
    plain.evict(6)
    device = KVPool(1, 1, 1, 8)
    tiered = TieredRadixCache(device, host_pool_for(device, 4), eviction_policy=policy)
    used(tiered, lambda: device.alloc(2))
    order = []
    for _ in keys:
        assert tiered.evict(2) == 2
        off = [name(n) for n in tiered.nodes()[1:] if "device" not in tiered.tiers(n)]
        order += [n for n in off if n not in order]
        tiered.check_invariants()
    assert "".join("ABC"[int(s[0]) // 2] for s in plain_order) == device_order
    left = set(keys) - {name(n) for n in tiered.nodes()[1:]}
    assert "".join(order) == device_order and left == {left_the_host}
    assert device.num_free == device.num_slots and tiered.host_size == 4


def test_the_engine_gets_the_tiers_through_chapter_6s_kv_factory_registry(tokenizer):
    code = "import sys, kvlearn.serving.engine; print(sorted(m for m in sys.modules if 'tiers' in m))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True, check=True).stdout
    assert loaded.strip() == "[]"  # chapter 6 does not import chapter 8
    engine = Engine(tiny_model(), tokenizer, num_slots=64, host_slots=32)
    assert isinstance(engine.kv, TieredRadixKV) and engine.kv.tree.host.num_slots == 32
    plain = Engine(tiny_model(), tokenizer, num_slots=64)
    assert not isinstance(plain.kv, TieredRadixKV) and plain.kv.counters() == engine.kv.counters()


# --- the real model ----------------------------------------------------------------------------------
def test_tier_options_are_checked_before_anything_is_built(model, tokenizer, tmp_path):
    for bad, error, message in (
            (dict(write_policy="lazy"), ValueError, "write_policy"),
            (dict(cache="blocks", host_slots=64), ValueError, "cache='radix'"),
            (dict(host_slots=0), ValueError, "host_slots"),
            (dict(host_slots=2.5), TypeError, "host_slots"),
            (dict(host_slots=30, page_size=4, num_slots=64), ValueError, "multiple of page_size"),
            (dict(disk_dir=tmp_path / "missing"), ValueError, "does not exist")):
        with pytest.raises(error, match=message):
            Engine(model, tokenizer, **bad)
    stats = Engine(model, tokenizer, num_slots=64).stats
    assert stats["offloaded_tokens"] == stats["loaded_from_host_tokens"] == stats["loaded_from_disk_tokens"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(host_slots=512),
                                     dict(host_slots=128, disk_dir=True, write_policy="write_through"),
                                     dict(host_slots=16, disk_dir=True, disk_max_bytes=3 * 740_000)],
                         ids=["host", "host+disk", "host+small disk"])
def test_tiers_under_pressure_give_hf_tokens(model, tokenizer, tmp_path, options):
    """Multi-turn chat in a device pool of ~20% of its need: prefixes move down and come back
    (every step checks slot conservation in both pools) and the tokens stay Hugging Face's."""
    chat = make_workload("multi_turn", tokenizer, num_conversations=2, num_turns=2)
    max_new = 4
    need = sum(len(p) + max_new for p in chat.prompts)
    slots = max(need // 5, max(len(p) for p in chat.prompts) + max_new)
    options = {**options, "disk_dir": tmp_path} if "disk_dir" in options else options
    engine = Engine(model, tokenizer, num_slots=slots, **options)
    outputs, loaded = [], 0
    for turn in range(2):  # a round of both conversations at a time, as users take turns
        outputs += engine.generate(chat.prompt_lists()[2 * turn:2 * turn + 2], max_new_tokens=max_new)
        loaded += engine.stats["loaded_from_host_tokens"] + engine.stats["loaded_from_disk_tokens"]
    for out, prompt in zip(outputs, chat.prompts, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, max_new)
    assert loaded > 0 and engine.stats["offloaded_tokens"] > 0
    if "disk_max_bytes" in options:  # three pages of 16 tokens' fp32 KV (720 KiB each)
        disk = engine.kv.tree.disk
        assert disk.stats["pages_evicted"] > 0 and disk.used_bytes() <= disk.max_bytes
    engine.kv.tree.check_invariants()
    engine.evict_all()
    assert engine.pool.num_free == engine.pool.num_slots


@pytest.mark.slow
def test_a_new_engine_reuses_the_disk_folder_and_refuses_damaged_files(model, tokenizer, tmp_path):
    shared = make_workload("shared_system", tokenizer, num_requests=2)
    prompts, max_new = shared.prompt_lists(), 4
    first = Engine(model, tokenizer, num_slots=1024, disk_dir=tmp_path, write_policy="write_through")
    first.generate(prompts, max_new_tokens=max_new)
    assert first.stats["loaded_from_disk_tokens"] == 0 and list(tmp_path.glob("*.kv"))
    second = Engine(model, tokenizer, num_slots=1024, disk_dir=tmp_path)  # a restart: an empty tree
    outputs = second.generate(prompts, max_new_tokens=max_new)
    stats = second.stats
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, max_new) for p in prompts]
    page = second.kv.tree.disk.page_tokens
    assert stats["computed_prefill_tokens"] <= len(prompts) * page  # only each prompt's last partial page
    assert stats["loaded_from_disk_tokens"] >= len(prompts[0]) - page
    for path in tmp_path.glob("*.kv"):  # damage every file: all misses, nothing wrong loaded
        path.write_bytes(path.read_bytes()[:-3])
    third = Engine(model, tokenizer, num_slots=1024, disk_dir=tmp_path)
    outputs = third.generate(prompts[:1], max_new_tokens=max_new)
    assert outputs[0].token_ids == hf_greedy(model, prompts[0], max_new)
    assert third.stats["loaded_from_disk_tokens"] == 0 and third.stats["disk_entries_rejected"] > 0


# --- the disk tier's capacity and bad entries ---------------------------------------------------------
def test_the_disk_keeps_under_its_capacity_least_recently_used_first_across_a_restart(tmp_path):
    def store():
        probe = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4)
        return DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4, max_bytes=3 * probe.max_entry_bytes)

    disk = store()
    pages = {k: [k] * 4 for k in range(1, 7)}
    for k in (1, 2, 3):
        disk.put(k, pages[k], page(k))
    assert disk.lru_order() == [1, 2, 3] and disk.stats["pages_evicted"] == 0
    assert torch.equal(disk.get(1, pages[1]), page(1))  # a read is a use: 2 is now the oldest
    disk.put(4, pages[4], page(4))
    assert disk.lru_order() == [3, 1, 4] and disk.stats["pages_evicted"] == 1
    assert disk.used_bytes() <= disk.max_bytes and not disk.contains(2)
    disk.put(3, pages[3], page(3.5))  # rewriting an entry evicts nothing and makes it the newest
    assert disk.lru_order() == [1, 4, 3] and disk.stats["pages_evicted"] == 1
    again = store()  # a restart: the order lives in the folder
    assert again.lru_order() == [1, 4, 3]
    again.touch(1)
    again.put(5, pages[5], page(5))
    assert again.lru_order() == [3, 1, 5] and again.stats["pages_evicted"] == 1
    assert again.used_bytes() <= again.max_bytes
    (tmp_path / ".tmp-stale.kv").write_bytes(b"x" * 10**5)  # a killed writer's leftover: not an entry
    assert again.used_bytes() <= again.max_bytes and again.sweep_temporary(older_than_s=0) == 1


def test_a_disk_capacity_below_one_entry_is_refused(model, tokenizer, tmp_path):
    probe = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4)
    with pytest.raises(ValueError, match="at least one entry"):
        DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4, max_bytes=probe.max_entry_bytes - 1)
    with pytest.raises(ValueError, match="give disk_dir"):
        Engine(model, tokenizer, num_slots=64, host_slots=64, disk_max_bytes=10**6)
    with pytest.raises(TypeError, match="disk_max_bytes"):
        Engine(model, tokenizer, num_slots=64, disk_dir=tmp_path, disk_max_bytes=1.5e6)
    with pytest.raises(ValueError, match="at least one entry"):
        Engine(model, tokenizer, num_slots=64, disk_dir=tmp_path, disk_max_bytes=1000)


def test_a_bad_entry_is_replaced_when_its_page_is_written_again(tmp_path):
    disk = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4)
    disk.put(9, [1, 2, 3, 4], page(1.0))
    path = disk.path(9)
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    assert disk.contains(9) and disk.get(9, [1, 2, 3, 4]) is None and not disk.contains(9)
    disk.put(9, [1, 2, 3, 4], page(1.0))
    assert disk.contains(9) and torch.equal(disk.get(9, [1, 2, 3, 4]), page(1.0))
    # Damage found before any read: the tree asks `holds` (the header and the size) before a write.
    raw = path.read_bytes()
    for damaged, reason in ((raw[:-1], "truncated"), (raw + b"x", "corrupt"),
                            (raw.replace(b'"model": "m"', b'"model": "n"'), "foreign")):
        fresh = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4)  # knows nothing bad yet
        path.write_bytes(damaged)
        assert fresh.contains(9) and not fresh.holds(9, [1, 2, 3, 4]) and fresh.stats[f"miss_{reason}"] == 1
        fresh.put(9, [1, 2, 3, 4], page(1.0))
        assert fresh.holds(9, [1, 2, 3, 4]) and torch.equal(fresh.get(9, [1, 2, 3, 4]), page(1.0))
    assert disk.holds(9, [1, 2, 3, 4]) and not disk.holds(9, [1, 2, 3, 5])  # other tokens: never theirs


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_the_tree_rewrites_a_page_it_found_bad(tmp_path, damage):
    """A prefix goes to disk, its file is damaged, a match misses it (computed again), and when the
    prefix leaves memory again the file is replaced by a valid one."""
    from kvlearn.tiers import TieredRadixCache

    pool = KVPool(1, 1, 1, 8)
    disk = DiskStore(tmp_path, "toy", torch.float32, (1, 1, 1), 4)
    tree = TieredRadixCache(pool, None, disk)
    key = [1, 2, 3, 4, 5]

    def compute_and_cache():
        slots = pool.alloc(5)
        pool.kv[0, 0, slots, 0, 0] = torch.tensor(key, dtype=torch.float32)
        tree.insert(key, slots)

    compute_and_cache()
    tree.evict(8)  # no host: the prefix leaves memory, its full page goes to disk
    path = disk.files()[0]
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:-3], "flip": raw[:-1] + bytes([raw[-1] ^ 1]),
                      "foreign": raw.replace(b'"toy"', b'"yot"')}[damage])
    match = tree.match_prefix(key)
    tree.lock(match.last_node)
    slots = pool.alloc(4)
    end, node = tree.load_back(key, match.last_node, slots)
    assert end == 0 and tree.stats["loaded_from_disk_tokens"] == 0  # a miss, counted by reason
    assert sum(disk.stats[f"miss_{r}"] for r in ("truncated", "corrupt", "foreign")) == 1
    tree.unlock(node)
    pool.free(slots)
    compute_and_cache()
    tree.evict(8)
    kv = disk.get(disk.entry_keys(key)[0], key[:4])
    assert kv is not None and kv[0, 0, :, 0, 0].tolist() == [1, 2, 3, 4]
    tree.check_invariants()
    assert pool.num_free == pool.num_slots


def test_a_disk_page_found_bad_is_not_loaded_past_the_slots_even_once_readable_again(tmp_path):
    """A file found bad leaves `reachable_len`, which sizes the caller's slots; if the file becomes
    readable again (restored by hand, say), `load_back` still loads only into the slots it got."""
    pool = KVPool(1, 1, 1, 12, page_size=2)
    disk = DiskStore(tmp_path, "toy", torch.float32, (1, 1, 1), 4)
    tree = TieredRadixCache(pool, None, disk, "write_back")
    key = [0, 0, 0, 0]
    tree.insert(key, pool.alloc(4))
    tree.evict(4)                                   # write-back: the page goes to disk
    path = disk.files()[0]
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))

    def load():
        match = tree.match_prefix(key)
        tree.lock(match.last_node)
        slots = torch.cat([match.indices, pool.alloc(tree.reachable_len(key) - len(match))])
        end, node = tree.load_back(key, match.last_node, slots)
        pool.free(slots[end:])
        tree.unlock(node)
        return end

    assert load() == 0 and disk.stats["miss_corrupt"] == 1   # found bad
    path.write_bytes(raw)                                    # readable again
    assert tree.reachable_len(key) == 0 and load() == 0      # still a miss: never past the slots
    assert pool.num_free == pool.num_slots
