"""`kvlearn.parts.check` keeps its promise: time limits that catch endless loops but not slow laptops
(per call, relative to the package's own part timed on the same programs), a failed report for
whatever the part raises (a real Ctrl-C still stops the check), options refused when they make no
sense, a checker that a part cannot replace, and kvlearn's own failures reported as kvlearn's."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import kvlearn.parts
from kvlearn.allocator import PageAllocator
from kvlearn.exercises.parts import check_part
from kvlearn.parts import PARTS, check, suite_allocator
from kvlearn.radix import RadixCache


def loop_attention(query, key, value, layer, kv_pool, md, scale=None):
    """Chapter 5's attention one sequence and one new token at a time: correct, and slow (a Python
    loop where the package's paged_attention works on whole tensors)."""
    kv_pool.write(layer, md.slot_mapping, key, value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    group = query.shape[1] // key.shape[1]
    out, row = torch.empty_like(query), 0
    for b in range(len(md.kv_lens)):
        n, q = int(md.kv_lens[b]), int(md.last_token[b]) + 1 - row
        context = md.kv_indices[b, :n]
        k = kv_pool.k[layer][context].repeat_interleave(group, dim=1).to(query.dtype)
        v = kv_pool.v[layer][context].repeat_interleave(group, dim=1).to(query.dtype)
        for i in range(q):
            sees = n - q + i + 1                       # its own position and everything before it
            scores = torch.einsum("hd,khd->hk", query[row], k[:sees]) * scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:sees])
            row += 1
    return out


class LoopsForever(RadixCache):
    def evict(self, num_tokens):
        while True:
            pass


class SleepsInEveryCall(PageAllocator):
    """Correct, but each alloc and free takes 20 ms: some thousand times the package's."""

    def alloc(self, n):
        time.sleep(0.02)
        return super().alloc(n)

    def free(self, pages):
        time.sleep(0.02)
        return super().free(pages)


def test_a_correct_but_slow_part_passes_on_a_busy_machine():
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        start = time.perf_counter()
        report = check("attention", loop_attention, programs=100)
        took = time.perf_counter() - start
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert report.passed, report.message
    assert "Its calls took" in report.message and "the package's paged_attention" in report.message
    assert report.seconds > 0 and report.reference_seconds > 0
    print(f"busy machine: the check took {took:.1f} s; the part's calls {report.seconds:.2f} s, "
          f"the package's {report.reference_seconds:.2f} s")


def test_an_endless_loop_fails_within_seconds():
    start = time.perf_counter()
    report = check("radix_cache", LoopsForever)
    took = time.perf_counter() - start
    assert not report.passed and "did not return within 2 s" in report.message, report.message
    assert "cache.evict(" in report.message.splitlines()[-3]
    assert took < 15, took
    print(f"endless loop: failed after {took:.1f} s")


def test_an_endless_loop_is_stopped_off_the_main_thread_too():
    reports = []
    worker = threading.Thread(target=lambda: reports.append(check("radix_cache", LoopsForever, time_limit_s=0.5)))
    worker.start()
    worker.join(60)
    assert reports and not reports[0].passed and "did not return within 0.5 s" in reports[0].message
    time.sleep(0.5)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvlearn.parts.check")]   # the loop stopped


def test_a_part_slow_in_every_call_fails_on_the_total_limit():
    report = check("allocator", SleepsInEveryCall, time_limit_s=0.05)
    assert not report.passed and "All programs together took more than" in report.message, report.message
    assert "times the package's PageAllocator" in report.message


def test_a_real_ctrl_c_stops_the_check():
    released = threading.Event()

    class Slow(RadixCache):
        def evict(self, num_tokens):
            while not released.is_set():
                time.sleep(0.01)
            return 0

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            check("radix_cache", Slow, time_limit_s=60)
        assert time.perf_counter() - start < 10
    finally:
        timer.cancel()
        released.set()
        signal.signal(signal.SIGINT, previous)


class Raises(PageAllocator):
    error: BaseException = KeyboardInterrupt()

    def alloc(self, n):
        raise self.error


class Mine(BaseException):
    def __str__(self):
        raise RuntimeError("no message")


@pytest.mark.parametrize("error", [KeyboardInterrupt(), GeneratorExit(), Mine(), SystemExit(3)],
                         ids=["KeyboardInterrupt", "GeneratorExit", "custom", "SystemExit"])
@pytest.mark.parametrize("thread", ["main", "worker"])
def test_whatever_the_part_raises_is_a_failed_report(error, thread):
    part = type("Raises", (Raises,), {"error": error})
    reports = []
    if thread == "main":
        reports.append(check("allocator", part))
    else:
        worker = threading.Thread(target=lambda: reports.append(check("allocator", part)))
        worker.start()
        worker.join(60)
    assert reports and not reports[0].passed
    assert type(error).__name__ in reports[0].message and "did not return" not in reports[0].message


@pytest.mark.parametrize("options, error", [
    ({"programs": 0}, ValueError), ({"programs": -3}, ValueError), ({"programs": 2.0}, TypeError),
    ({"programs": True}, TypeError), ({"time_limit_s": float("inf")}, ValueError),
    ({"time_limit_s": float("nan")}, ValueError), ({"time_limit_s": 0}, ValueError),
    ({"time_limit_s": -1.0}, ValueError), ({"time_limit_s": "1"}, TypeError), ({"time_limit_s": True}, TypeError),
])
def test_options_that_make_no_sense_are_refused(options, error, capsys):
    with pytest.raises(error):
        check("allocator", PageAllocator, **options)
    with pytest.raises(error):
        check_part("allocator", PageAllocator, **options)
    assert capsys.readouterr().out == ""   # nothing was judged


def test_a_part_that_replaces_the_checker_fails_and_the_checker_is_put_back():
    same = suite_allocator.same

    class Silences(PageAllocator):   # wrong, and hides it: every comparison of the suite passes
        def __init__(self, *args, **kwargs):
            suite_allocator.same = lambda *a, **k: None
            super().__init__(*args, **kwargs)

        def alloc(self, n):
            return super().alloc(n).flip(0)

    report = check("allocator", Silences)
    assert not report.passed and "kvlearn's checker was changed" in report.message, report.message
    assert "suite_allocator.same" in report.message
    assert suite_allocator.same is same
    assert check("allocator", PageAllocator, programs=20).passed


def test_a_check_swapped_in_kvlearn_parts_is_put_back(monkeypatch):
    genuine = kvlearn.parts.check
    monkeypatch.setattr(kvlearn.parts, "check", lambda *args, **kwargs: "passed")
    report = genuine("allocator", PageAllocator, programs=5)
    assert not report.passed and "kvlearn.parts.check" in report.message
    assert kvlearn.parts.check is genuine


def test_check_part_uses_the_checker_kvlearn_imported(monkeypatch, capsys):
    monkeypatch.setattr(kvlearn.parts, "check", lambda *args, **kwargs: "passed")
    assert check_part("allocator", PageAllocator, programs=5) is False
    assert "kvlearn.parts.check" in capsys.readouterr().out


def test_a_failure_of_kvlearn_s_own_code_is_reported_as_the_checker_s_bug(monkeypatch):
    def boom(*args, **kwargs):
        raise SystemExit("a bug")

    monkeypatch.setattr(PageAllocator, "alloc", boom)   # the package's own part, the reference
    report = check("allocator", PARTS["allocator"], programs=5)
    assert not report.passed and "bug in kvlearn's checker, please report it" in report.message, report.message
    assert "SystemExit" in report.message and "PageAllocator fails program" in report.message
    monkeypatch.undo()

    monkeypatch.setattr(torch, "allclose", lambda *args, **kwargs: 1 / 0)   # the suite's own comparison
    report = check("attention", loop_attention, programs=5)
    assert not report.passed and "bug in kvlearn's checker" in report.message, report.message
    assert "ZeroDivisionError" in report.message
