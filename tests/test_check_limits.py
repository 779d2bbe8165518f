"""`kvlearn.parts.check` keeps its promise: a time limit per call (the standard library's
`signal.setitimer`) that catches endless loops but not slow laptops, a failed report for whatever
the part raises (a real Ctrl-C still stops the check), options refused when they make no sense, and
a failure the suite cannot read reported as possibly kvlearn's."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvlearn.allocator import PageAllocator
from kvlearn.exercises.parts import check_part
from kvlearn.parts import check
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


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
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
    assert report.passed and "Its calls took" in report.message, report.message
    assert report.seconds > 0
    print(f"busy machine: the check took {took:.1f} s; the part's calls {report.seconds:.2f} s")


def test_an_endless_loop_fails_within_seconds():
    start = time.perf_counter()
    report = check("radix_cache", LoopsForever)
    took = time.perf_counter() - start
    assert not report.passed and "did not return within 2 s" in report.message, report.message
    assert "cache.evict(" in report.message.splitlines()[-3]
    assert took < 15, took
    print(f"endless loop: failed after {took:.1f} s")


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
    error: BaseException = SystemExit()

    def alloc(self, n):
        raise self.error


class Mine(BaseException):
    def __str__(self):
        raise RuntimeError("no message")


@pytest.mark.parametrize("error", [GeneratorExit(), Mine(), SystemExit(3)],
                         ids=["GeneratorExit", "custom", "SystemExit"])
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


def test_a_failure_the_suite_cannot_read_may_be_kvlearn_s_and_says_so(monkeypatch):
    monkeypatch.setattr(torch, "allclose", lambda *args, **kwargs: 1 / 0)   # the suite's own comparison
    report = check("attention", loop_attention, programs=5)
    assert not report.passed and "this is a bug in kvlearn's checker: please report it" in report.message
    assert "ZeroDivisionError" in report.message
