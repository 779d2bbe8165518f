"""The chapter 6 part: a learner's scheduler (the step's decisions on top of `SchedulerBase`), judged
by `check("scheduler", ...)` against the package's `Scheduler`, and serving the engine.

`MyScheduler` is written the way a learner would, outside the package: it inherits only the
documented base, never `Scheduler`. The buggy ones change one decision each.
"""

import pytest

from kvlearn.errors import KVCapacityError
from kvlearn.parts import PARTS, SchedulerBase, check
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import make_kv_manager
from kvlearn.serving.config import EngineConfig
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler
from kvlearn.serving.simulate import SimEngine


class MyScheduler(SchedulerBase):
    """Decode, then chunks, then admissions, one method each (so a buggy variant changes one)."""

    def schedule(self):
        self.begin_step()
        decodes = self.decodes()
        budget = self.max_batch_tokens - len(decodes)
        chunks = []
        for req in self.running:
            if req.prefilling and budget > 0:
                n = min(req.prefill_len - req.num_computed, budget)
                chunks.append((req, n))
                budget -= n
        prefills = self.admissions(budget) if not self.report.preempted else []
        return self.form_batch(prefills, chunks, decodes)

    def decodes(self):
        out = []
        for req in list(self.running):
            if req not in self.running:      # preempted while an older request looked for room
                continue
            if req.prefilling:
                continue
            while not self.kv.grow(req):
                if not self.make_room(req):
                    break
            else:
                out.append(req)
        return out

    def make_room(self, req):
        """Preempt the newest; False when that was `req` itself."""
        victim = self.running[-1]
        self.preempt(victim)
        return victim is not req

    def order(self):
        return self.queue_order()

    def admissions(self, budget):
        admitted = []
        for req, cached in self.order():
            if budget <= 0:
                break
            if not self.chunked_prefill and len(req.token_ids) - cached > budget and (admitted or self.running):
                break
            if self.shares_in_batch(req, cached):
                self.report.deferred.append(req.rid)
                continue
            n = self.start(req, budget)
            if n is None:
                break
            admitted.append((req, n))
            budget -= n
        return admitted


class NeverPreempts(MyScheduler):
    def make_room(self, req):
        raise KVCapacityError("no slot left for the next token")


class PreemptsTheOldest(MyScheduler):
    def make_room(self, req):
        victim = self.running[0]
        self.preempt(victim)
        return victim is not req


class IgnoresTheBudget(MyScheduler):
    def admissions(self, budget):
        return super().admissions(self.max_batch_tokens * 100)


class AdmitsShortestFirst(MyScheduler):
    def order(self):
        return sorted(self.queue_order(), key=lambda pair: len(pair[0].token_ids))


class NeverDefers(MyScheduler):
    def shares_in_batch(self, req, cached):
        return False


class Empty:
    pass


class NoDecisions(SchedulerBase):    # schedule() is the base's: NotImplementedError
    pass


class Skeleton(SchedulerBase):       # the student copy's skeleton: a body of `...`
    def schedule(self):
        ...


def test_the_package_scheduler_is_the_base_plus_the_decisions():
    assert PARTS["scheduler"] is Scheduler and issubclass(Scheduler, SchedulerBase)
    assert set(vars(Scheduler)) - set(vars(SchedulerBase)) <= {"schedule", "_decodes", "_admit", "__doc__",
                                                               "__module__", "__qualname__", "__firstlineno__",
                                                               "__static_attributes__"}


def test_a_scheduler_written_outside_the_package_passes():
    assert not issubclass(MyScheduler, Scheduler)
    report = check("scheduler", MyScheduler)
    assert report.passed, report.message
    assert report.calls > 3000 and "meets the scheduler contract (chapter 6)" in report.message


BUGGY = [
    (NeverPreempts, ["KVCapacityError", "scheduler.schedule()", "preempt the newest running request"]),
    (PreemptsTheOldest, ["batch = scheduler.schedule()", "self.running[-1]"]),
    (IgnoresTheBudget, ["prefills: expected", "while budget is left"]),
    (AdmitsShortestFirst, ["expected", "queue_order()"]),
    (NeverDefers, ["deferred: expected", "report.deferred"]),
    (Empty, ["Not yet", "lacks", "schedule", "postprocess"]),
    (NoDecisions, ["Not yet", "NotImplementedError"]),
    (Skeleton, ["returned None", "form_batch"]),
]


@pytest.mark.parametrize("impl, words", BUGGY, ids=[b[0].__name__ for b in BUGGY])
def test_known_buggy_schedulers_fail_with_a_message(impl, words):
    report = check("scheduler", impl)
    assert not report.passed
    for word in words:
        assert word in report.message, report.message
    calls = [line for line in report.message.splitlines() if line.startswith("    ")]
    assert len(calls) <= 30, report.message     # shrunk to a readable example


def test_check_never_raises_because_of_the_scheduler():
    for impl in (None, lambda *args, **kw: 1 / 0, type("Raises", (MyScheduler,), {"schedule": lambda self: {}[0]})):
        report = check("scheduler", impl)
        assert not report.passed and report.message


def test_the_engine_and_the_simulator_take_a_scheduler_part():
    assert EngineConfig(cache="blocks", parts={"scheduler": MyScheduler}).parts["scheduler"] is MyScheduler
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 8], [1, 2, 3, 4, 5, 6, 7]] * 3
    runs = []
    for cls in (Scheduler, MyScheduler):
        sim = SimEngine(make_kv_manager("radix", KVPool(1, 1, 1, 24)), filler=3, scheduler_cls=cls, max_batch_tokens=8)
        assert type(sim.scheduler) is cls
        for rid, p in enumerate(prompts):
            sim.add(Request(rid, p, 5))
        reports = []
        while sim.has_unfinished():
            sim.step()
            reports.append(repr(sim.scheduler.report))
        runs.append((reports, sim.stats))
    assert runs[0] == runs[1] and runs[0][1]["preemptions"] > 0 and runs[0][1]["cached_tokens"] > 0


class Delegating:
    """A scheduler part not built on `SchedulerBase`: the contract's members, answered by a Scheduler."""

    def __init__(self, kv, **options):
        self.inner = Scheduler(kv, **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_simulator_fast_forwards_a_part_on_the_base_and_steps_any_other():
    """`SimEngine.run` runs stretches of decodes for a `SchedulerBase` part, one step at a time for
    another part, with the same result."""
    prompts = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4], [7, 8]]     # no shared prefix: all admitted at once
    runs = []
    for cls in (Scheduler, MyScheduler, Delegating):
        sim = SimEngine(make_kv_manager("radix", KVPool(1, 1, 1, 96)), filler=3, scheduler_cls=cls)
        for rid, p in enumerate(prompts):
            sim.add(Request(rid, p, 30))
        sim.step()
        runs.append((sim.decode_stretch(), sim.run()))
    assert runs[0][0][0] > 20 and runs[1] == runs[0]
    assert runs[2] == ((0, False), runs[0][1])


@pytest.mark.thorough   # chapter 9 serves the learner's scheduler in both engines under nbval
@pytest.mark.parametrize("cache", ["radix", "blocks"])
def test_a_scheduler_written_outside_the_package_serves_the_real_model(model, tokenizer, cache):
    from kvlearn import Engine
    from kvlearn.serving.workloads import make_workload

    prompts = make_workload("shared_system", tokenizer, num_requests=4).prompt_lists()
    options = dict(cache=cache, num_slots=384 if cache == "radix" else 448, max_batch_tokens=96)
    theirs = Engine(model, tokenizer, **options)
    ours = Engine(model, tokenizer, **options, parts={"scheduler": MyScheduler})
    assert type(ours.scheduler) is MyScheduler
    expected = [out.token_ids for out in theirs.generate(prompts, max_new_tokens=8)]
    assert [out.token_ids for out in ours.generate(prompts, max_new_tokens=8)] == expected
    for key in ("steps", "computed_prefill_tokens", "cached_tokens", "preemptions", "peak_slots"):
        assert ours.stats[key] == theirs.stats[key], key
    ours.evict_all()
    assert ours.pool.num_free == ours.pool.num_slots


@pytest.mark.parametrize("chunked, slots, budget, prompts, stopped", [
    (True, 64, 4, [[1, 2, 3, 4], [2, 3]], "budget"),          # the first prompt spends the budget
    (False, 64, 6, [[1, 2, 3], [3, 1, 2, 3, 1, 2]], "wait"),  # too big for what is left, without chunks
    (True, 4, 16, [[1, 2, 3], [2, 3, 1]], "full"),            # the pool holds one prompt
    (True, 64, 16, [[1, 2]], ""),                              # the queue ran out
])
def test_the_scheduler_says_why_its_admission_stopped(chunked, slots, budget, prompts, stopped):
    """The referee's report names the rule that stopped admission: the hint a wrong part's step gets."""
    scheduler = Scheduler(make_kv_manager("none", KVPool(1, 1, 1, slots)), budget, "fcfs", (9,),
                          chunked_prefill=chunked)
    for rid, prompt in enumerate(prompts):
        scheduler.add(Request(rid, prompt, 4, 1))
    scheduler.schedule()
    assert scheduler.report.stopped == stopped and len(scheduler.report.prefills) == 1
