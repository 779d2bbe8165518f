"""Issue 25: the disk tier is a cache. An OS error on any disk operation drops a page or makes a
read a miss (counted, warned once), hostile files under an entry's name are misses in bounded time
and memory, an abort finishes every request before it raises, write_back survives a clean exit,
and `route` refuses a fleet that does not fit in memory and a trace that is not text."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvlearn.pool import KVPool
from kvlearn.routing.traces import TraceError, read_trace
from kvlearn.serving.cache_modes import RadixKV
from kvlearn.serving.engine import Engine
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler
from kvlearn.tiers import DiskStore, TieredRadixKV
from kvlearn.tiers.disk import ERROR_KINDS
from tests.test_engine import EOS, reference
from tests.test_tiers import SHAPE, PoolForward, page

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1 + i % 3] * 12 + [20 + i] * 6 for i in range(6)]  # three shared heads, six tails
MAX_NEW = 6


# --- injecting OS errors ------------------------------------------------------------------------------
def _broken(real, error: int, folder: str, path_arg: int = 0):
    """`real` (an os function), raising OSError(error) for paths under `folder`."""
    def call(*args, **kwargs):
        path = kwargs.get("dir") if path_arg is None else args[path_arg] if len(args) > path_arg else None
        if path is not None and not isinstance(path, int) and os.fspath(path).startswith(folder):
            call.hits += 1
            raise OSError(error, os.strerror(error), os.fspath(path))
        return real(*args, **kwargs)
    call.hits = 0
    return call


@contextmanager
def failing(monkeypatch, operation: str, error: int, folder):
    """Make one disk operation fail with `error` in `folder` (what a read-only or full file system,
    a bad disk or a permission change does), as the OS would: for every call while inside."""
    folder = os.fspath(folder)
    if operation == "write":  # creating the temporary file
        fake = _broken(tempfile.mkstemp, error, folder, path_arg=None)
        monkeypatch.setattr(tempfile, "mkstemp", fake)
    else:
        name = {"replace": "replace", "stamp": "utime", "read": "open", "list": "scandir",
                "delete": "unlink"}[operation]
        fake = _broken(getattr(os, name), error, folder)
        monkeypatch.setattr(os, name, fake)
    try:
        yield fake
    finally:
        monkeypatch.undo()


# --- the tiered manager under the scheduler, with a stand-in model ------------------------------------
def serve(kv, prompts, rid0=0):
    """Serve the prompts on a tiered manager (checking slot conservation every step); outputs."""
    scheduler, forward = Scheduler(kv, 64, "fcfs", (EOS,)), PoolForward(kv.pool)
    requests = [Request(rid0 + i, p, MAX_NEW) for i, p in enumerate(prompts)]
    for req in requests:
        scheduler.add(req)
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, forward(batch))
        kv.tree.check_invariants()
    return [r.output_ids for r in requests]


def tiered(folder, policy="write_back", num_slots=48, max_bytes=None):
    pool = KVPool(1, 1, 1, num_slots)
    return TieredRadixKV(pool, disk=DiskStore(folder, "stand-in", torch.float32, (1, 1, 1), 4, max_bytes=max_bytes),
                         write_policy=policy)


def disk_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "kvlearn disk tier" in str(w.message)]


OPERATIONS = ("write", "replace", "stamp", "read", "list", "delete")
ERRORS = ("EROFS", "ENOSPC", "EISDIR", "ENOTDIR", "EACCES", "EIO")


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_an_os_error_on_any_disk_operation_is_a_miss_counted_and_warned_once(tmp_path, monkeypatch,
                                                                              operation, error):
    """A folder full of pages, then broken for one operation: requests still get the right tokens
    (every step checks slot conservation), the error is counted by kind and warned once with the
    folder's name; once the folder works again, pages are written again."""
    entry = DiskStore(tmp_path, "stand-in", torch.float32, (1, 1, 1), 4).max_entry_bytes
    kv = tiered(tmp_path, num_slots=48, max_bytes=6 * entry)  # evictions on the device and on disk
    expected = [reference(p, MAX_NEW) for p in PROMPTS]
    assert serve(kv, PROMPTS) == expected
    disk = kv.tree.disk
    assert disk.stats["pages_written"] > 0 and disk.stats["errors"] == 0
    with warnings.catch_warnings(record=True) as caught, \
            failing(monkeypatch, operation, getattr(errno, error), tmp_path) as fake:
        warnings.simplefilter("always")
        for r in range(2):  # returning users: reads, writes, stamps and deletes of a full disk
            assert serve(kv, PROMPTS[::-1], rid0=100 * (r + 1)) == expected[::-1]
        kv.evict_all()  # everything leaves memory: written down, or dropped
        assert kv.pool.num_free == kv.pool.num_slots
        assert fake.hits > 0, f"the run never reached {operation}"
    kind = f"errors_{error.lower()}"
    assert disk.stats["errors"] == disk.stats[kind] == fake.hits
    assert kv.counters()["disk_errors"] == kv.counters()[f"disk_{kind}"] == fake.hits
    [message] = disk_warnings(caught)  # once per store, however many errors
    assert str(tmp_path) in message and error in message
    assert not list(tmp_path.glob(".tmp-*")), "a temporary file was left behind"
    # the folder works again: writes resume
    written = disk.stats["pages_written"]
    assert serve(kv, [[7] * 9 + p for p in PROMPTS], rid0=900) == [reference([7] * 9 + p, MAX_NEW) for p in PROMPTS]
    kv.evict_all()
    assert disk.stats["pages_written"] > written and disk.stats["errors"] == fake.hits
    assert disk.used_bytes() <= disk.max_bytes


def test_a_folder_replaced_by_a_file_or_removed_then_back(tmp_path):
    """Real errors, no injection: the folder replaced by a file (ENOTDIR), then removed (ENOENT),
    under write_through (every insert writes): right tokens, counted, one warning; back: writes."""
    folder = tmp_path / "kv"
    folder.mkdir()
    kv = tiered(folder, policy="write_through")
    expected = [reference(p, MAX_NEW) for p in PROMPTS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder.rmdir()
        folder.write_text("not a folder")
        assert serve(kv, PROMPTS) == expected
        assert kv.counters()["disk_errors_enotdir"] > 0
        folder.unlink()
        assert serve(kv, PROMPTS[::-1], rid0=100) == expected[::-1]
        assert kv.counters()["disk_errors_enoent"] > 0
    assert len(disk_warnings(caught)) == 1 and str(folder) in disk_warnings(caught)[0]
    assert kv.counters()["disk_pages_written"] == 0
    kv.evict_all()
    assert kv.pool.num_free == kv.pool.num_slots
    folder.mkdir()
    assert serve(kv, PROMPTS, rid0=200) == expected
    assert kv.counters()["disk_pages_written"] > 0 and list(folder.glob("*.kv"))


def test_a_folder_planted_under_an_entrys_name_is_a_miss_and_its_page_dropped(tmp_path):
    store = DiskStore(tmp_path, "m", torch.float32, SHAPE, page_tokens=4)
    store.path(7).mkdir()
    with pytest.warns(RuntimeWarning, match="EISDIR"):
        assert store.put(7, [1, 2, 3, 4], page(1.0)) is False  # os.replace: EISDIR
    assert store.stats["errors_eisdir"] == 1 and not list(tmp_path.glob(".tmp-*"))
    assert store.get(7, [1, 2, 3, 4]) is None and store.stats["miss_not_regular"] == 1
    assert not store.holds(7, [1, 2, 3, 4]) and not store.contains(7)
    assert store.files() == [] and store.put(8, [1, 2, 3, 4], page(1.0)) and store.files() == [store.path(8)]


# --- hostile files under an entry's name ----------------------------------------------------------------
HOSTILE = textwrap.dedent("""
    import os, resource, sys, time
    import torch
    from kvlearn.tiers import DiskStore
    folder = sys.argv[1]
    store = DiskStore(folder, "m", torch.float32, (2, 1, 3), page_tokens=4)
    os.mkfifo(os.path.join(folder, "fifo"))
    os.mkfifo(store.path(1))                                    # a FIFO
    os.symlink(os.path.join(folder, "fifo"), store.path(2))     # a link to a FIFO
    os.symlink("/dev/zero", store.path(3))                      # a link to an endless device
    store.path(4).mkdir()                                       # a folder
    with open(os.path.join(folder, "big"), "wb") as f:          # a huge sparse file
        f.truncate(1 << 40)
    os.symlink(os.path.join(folder, "big"), store.path(5))
    os.replace(os.path.join(folder, "big"), store.path(6))
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # reading any of them whole would fail
    start = time.monotonic()
    for key in range(1, 7):
        assert store.get(key, [1, 2, 3, 4]) is None, key
        assert not store.holds(key, [1, 2, 3, 4]) and not store.contains(key), key
    print({k: v for k, v in store.stats.items() if v}, round(time.monotonic() - start, 3))
""")


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_fifos_links_devices_and_folders_named_like_entries_are_misses_in_bounded_time_and_memory(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", HOSTILE, str(folder)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    stats, seconds = done.stdout.rsplit(" ", 1)
    stats = eval(stats)  # the store's non-zero counters
    assert stats == {"miss_not_regular": 2, "miss_link": 3, "miss_corrupt": 1}, stats
    assert float(seconds) < 5


# --- abort: every request leaves, then every error ------------------------------------------------
@pytest.mark.parametrize("failing", [(0,), (0, 2)])
def test_abort_takes_every_request_out_and_returns_their_slots_before_raising(tmp_path, monkeypatch, failing):
    kv = RadixKV(KVPool(1, 1, 1, 256))
    scheduler, forward = Scheduler(kv, 64, "fcfs", (EOS,)), PoolForward(kv.pool)
    requests = [Request(i, p, MAX_NEW) for i, p in enumerate(PROMPTS)]
    for req in requests:
        scheduler.add(req)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, forward(batch))
    assert len(scheduler.running) > 2
    release, failures = kv.release, []

    def fail_once(req):  # the first release of these requests fails (a disk write, say)
        if req.rid in failing and req.rid not in failures:
            failures.append(req.rid)
            raise OSError(errno.EIO, f"injected for r{req.rid}")
        release(req)
    monkeypatch.setattr(kv, "release", fail_once)
    with pytest.raises((OSError, ExceptionGroup)) as raised:
        scheduler.abort(requests)
    if len(failing) == 1:   # the one error itself
        assert isinstance(raised.value, OSError) and str(raised.value) == "[Errno 5] injected for r0"
    else:                   # every error, in order
        assert isinstance(raised.value, ExceptionGroup) and "2 releases failed" in str(raised.value)
        assert [str(e) for e in raised.value.exceptions] == ["[Errno 5] injected for r0", "[Errno 5] injected for r2"]
    assert failures == list(failing) and not scheduler.has_unfinished()
    assert all(r.status == "aborted" and r.kv is None for r in requests)
    kv.check([])
    kv.evict_all()
    assert kv.pool.num_free == kv.pool.num_slots and kv.rows.num_free == len(kv.rows.lengths)


def test_os_errors_during_generate_and_abort_leave_the_scheduler_whole(tmp_path, monkeypatch):
    """write_through writes at every insert, abort's releases included: a disk refusing every write
    costs pages, never requests or slots."""
    kv = tiered(tmp_path, policy="write_through", num_slots=64)
    scheduler, forward = Scheduler(kv, 64, "fcfs", (EOS,)), PoolForward(kv.pool)
    requests = [Request(i, p, MAX_NEW) for i, p in enumerate(PROMPTS)]
    for req in requests:
        scheduler.add(req)
    with warnings.catch_warnings(record=True), failing(monkeypatch, "replace", errno.EIO, tmp_path) as fake:
        warnings.simplefilter("always")
        for _ in range(3):
            batch = scheduler.schedule()
            scheduler.postprocess(batch, forward(batch))
        scheduler.abort(requests)
    assert fake.hits > 0 and kv.counters()["disk_errors_eio"] == fake.hits
    assert not scheduler.has_unfinished() and all(r.status in ("aborted", "finished") for r in requests)
    kv.evict_all()
    assert kv.pool.num_free == kv.pool.num_slots


# --- a clean exit under write_back --------------------------------------------------------------------
def test_flush_writes_what_memory_holds_and_a_new_manager_finds_it(tmp_path):
    kv = tiered(tmp_path, num_slots=256)  # room for everything: write_back never wrote anything
    expected = [reference(p, MAX_NEW) for p in PROMPTS]
    assert serve(kv, PROMPTS) == expected and not list(tmp_path.glob("*.kv"))
    kv.flush()
    written = kv.tree.disk.stats["pages_written"]
    assert written > 0
    kv.flush()  # idempotent
    assert kv.tree.disk.stats["pages_written"] == written
    again = tiered(tmp_path, num_slots=256)  # a restart
    assert serve(again, PROMPTS) == expected and again.counters()["loaded_from_disk_tokens"] > 0


@pytest.mark.slow
def test_a_write_back_engine_closed_cleanly_is_found_by_the_next_one(model, tokenizer, tmp_path):
    """Issue 25, case 6: write_back with room for everything used to leave an empty folder. Then
    case 1 on the real model: the folder replaced by a file, the same tokens, counted and warned."""
    folder, prompts = tmp_path / "kv", [[1, 2] * 20 + [3], [1, 2] * 20 + [4]]
    folder.mkdir()
    with Engine(model, tokenizer, num_slots=512, disk_dir=folder) as first:
        before = first.generate(prompts, max_new_tokens=3)
        assert not list(folder.glob("*.kv"))
    assert list(folder.glob("*.kv"))
    written = first.kv.tree.disk.stats["pages_written"]
    first.close()  # idempotent
    assert first.kv.tree.disk.stats["pages_written"] == written
    second = Engine(model, tokenizer, num_slots=512, disk_dir=folder)
    after = second.generate(prompts, max_new_tokens=3)
    assert second.stats["loaded_from_disk_tokens"] > 0
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="ENOTDIR"):
        again = second.generate([[5, 6] * 20 + [7]] + prompts, max_new_tokens=3)  # reads: misses
        second.evict_all()                                                         # writes: dropped
    assert [o.token_ids for o in again[1:]] == [o.token_ids for o in before]
    assert second.stats["disk_errors_enotdir"] > 0 and second.stats["disk_errors"] > 0
    assert second.pool.num_free == second.pool.num_slots and not second.has_unfinished()


# --- route: memory up front, text traces ---------------------------------------------------------------
def route(tmp_path, *args, limit=4 << 30):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"id": "r{i}", "arrival": {i / 10}, "prompt_ids": [1, 2, 3, {4 + i}], '
                             f'"max_new_tokens": 4}}\n' for i in range(20)))
    cap = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))"
    code = f"{cap}; import sys; from kvlearn.routing.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "--trace", str(trace), "--policy", "round_robin", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@pytest.mark.parametrize("args", [("--replicas", "100000"), ("--slots-per-replica", "20000000")])
def test_route_refuses_a_fleet_that_does_not_fit_in_memory(tmp_path, args):
    done = route(tmp_path, *args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "DefaultCPUAllocator" not in done.stderr
    assert "would preallocate about" in done.stderr and "GB" in done.stderr and args[0] in done.stderr


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_route_runs_a_fleet_that_fits(tmp_path):
    done = route(tmp_path, "--replicas", "8", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"requests": 20' in done.stdout


def test_an_allocation_the_estimate_missed_is_a_clear_error_too(tmp_path, monkeypatch, capsys):
    from kvlearn.routing import cli, fleet

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(fleet, "SimReplica", out_of_memory)  # where a replica allocates
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "prompt_ids": [1, 2], "max_new_tokens": 2}\n')
    assert cli.main(["--trace", str(trace), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "--replicas" in err and "DefaultCPUAllocator" not in err


def test_a_binary_or_non_utf8_trace_is_refused_with_its_name_and_line(tmp_path):
    binary = tmp_path / "trace.bin"
    binary.write_bytes(bytes([0x1f, 0xc7, 0x08, 0x00]) + os.urandom(64))
    with pytest.raises(TraceError, match=rf"{binary}:1: not UTF-8 text \(byte 0xc7 at column 2\)"):
        read_trace(binary)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"id": "a", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1}\n'
                      + '{"id": "caf\u00e9", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1}\n'.encode("latin-1"))
    with pytest.raises(TraceError, match=rf"{latin}:2: not UTF-8 text"):
        read_trace(latin)


def test_error_kinds_cover_the_issue():
    assert set(ERRORS) <= set(ERROR_KINDS)
