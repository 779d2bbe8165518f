"""The conformance suite of the `scheduler` part (chapter 6), judged by the package's `Scheduler`.

A program is an engine setup (cache mode, page size, a pool small enough for eviction and
preemption, a small token budget, fcfs or lpm, chunked prefill on or off, the in-batch threshold,
sometimes few rows) and random operations: add a request (a prompt over a 3-token alphabet, often
extending an earlier prompt, so prefixes are shared and deferred), run a step, and at the end run
every request to its end. No model: each request "samples" a token that depends only on its id and
position, sometimes the end-of-sequence token. The part and the reference each get a KV manager of
their own, built alike; every step, the part's decisions (who is preempted, decodes, computes a
chunk, is deferred, is admitted with how many tokens, and the batch itself) must be the
reference's. When they are not, the hint names the rule of the first decision that differs; for
admissions past the point where the reference stopped, the rule it stopped by (its report says
which: `StepReport.stopped`). After every step the queues,
statuses and stats must agree; at the end every request has finished with its tokens, and once
the cache is evicted every slot and row is free.
"""

from __future__ import annotations

import random

from kvlearn.parts.judge import Broken, Raised, Trace, describe
from kvlearn.parts.scheduler import SchedulerPart
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import make_kv_manager
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler

CONTRACT = SchedulerPart

EOS = 4
JUDGE = "the package's Scheduler on a KV manager of its own"   # what the passing report names

# The chapter's rules, in the order the referee (`Scheduler.schedule`) applies them.
HINTS = {
    "preempt": "1. decodes, oldest first: when kv.grow(req) returns False the pool has no slot for req's newest "
               "token, even after evicting: preempt the newest running request (self.running[-1], with "
               "self.preempt) and try again; if req was the newest, it is preempted itself and does not decode. "
               "A step that preempts admits nobody (chapter 6, section 4).",
    "decode": "1. decodes: every running request that is not still prefilling decodes one token, oldest first "
              "(self.running is in admission order): kv.grow(req) gives its newest token a slot. A request is "
              "still prefilling while req.num_computed < req.prefill_len (req.prefilling): it does not decode.",
    "chunk": "2. chunks, after the decodes: each running request still prefilling computes its next chunk, oldest "
             "first, min(req.prefill_len - req.num_computed, budget) while budget > 0, where budget = "
             "max_batch_tokens minus one token per decode (chapter 6, section 2).",
    "phases": "the rules run in order: 1. decodes, with their preemptions; 2. chunks, after the decodes, of the "
              "requests still running; 3. admissions, none in a step that preempted. A request preempted in "
              "this step is in no list of the batch.",
    "preempted": "3. admissions: a step that preempted admits nobody and defers nobody (the pool is short: the "
                 "waiting requests wait for a later step; chapter 6, section 4).",
    "budget": "3. admissions stop as soon as the budget is spent (budget <= 0: max_batch_tokens, minus one token "
              "per decode, minus the chunks' and the admissions' tokens). This stop comes before deferral: a "
              "request reached then must wait anyway, and is not deferred.",
    "wait": "3. admissions: without chunked prefill, a waiting request whose uncached part (len(req.token_ids) - "
            "cached) is bigger than the budget left stops admission while something runs or was admitted this "
            "step. This stop comes before deferral: a request that must wait anyway is not deferred.",
    "defer": "3. admissions, after the two stops (budget spent; too big without chunked prefill): a waiting request "
             "that shares_in_batch(req, cached) is deferred (its rid goes to self.report.deferred, it stays in "
             "the queue, the next one is tried); one that does not share is started (chapter 6, section 3).",
    "order": "3. admissions try the waiting requests in self.queue_order()'s order (fcfs: first come, first "
             "served; lpm: longest cached prefix first), each one once, never skipping ahead.",
    "admit": "3. admissions, while budget is left: self.start(req, budget) admits a request and returns the "
             "tokens it computes now; subtract them from the budget (max_batch_tokens, minus one token per "
             "decode, minus the chunks' tokens).",
    "full": "3. admissions: self.start(req, budget) returns None when the pool cannot hold req: that stops "
            "admission (a later, smaller request does not jump the line).",
    "batch": "end schedule() with return self.form_batch(prefills, chunks, decodes): prefills and chunks as "
             "(request, tokens) pairs, decodes as requests, each list in the order you decided.",
    "base": "begin_step() first, form_batch(...) last; add, postprocess, abort and the stats are "
            "SchedulerBase's: leave them to the base.",
}
# The step's decisions compared, in the referee's order, and the hint for each (admissions: `_admission_hint`).
DECISIONS = (("preempted", "preempt"), ("decodes", "decode"), ("chunks", "chunk"), ("deferred", None),
             ("prefills", None))


def generate(rng: random.Random) -> tuple[dict, list[tuple]]:
    cache = rng.choice(["radix", "radix", "blocks", "none"])
    page = rng.choice([2, 4]) if cache == "blocks" else rng.choice([1, 1, 2])
    setup = {"cache": cache, "page_size": page, "num_slots": page * rng.randint(12 // page, 40 // page),
             "max_requests": rng.choice([256, 256, 3]), "max_batch_tokens": rng.randint(2, 16),
             "schedule": rng.choice(["fcfs", "lpm"]), "chunked_prefill": rng.random() < 0.75,
             "in_batch_threshold": rng.choice([1, 1, 1, 0, 3])}
    ops = [(rng.choice(["add", "add", "step", "step", "step"]), rng.randrange(1 << 30))
           for _ in range(rng.randint(1, 20))]
    return setup, ops + [("drain", 0)]


def token(rid: int, k: int) -> int:
    """The token request `rid` "samples" as its k-th output: 1-3, or now and then EOS."""
    return EOS if (rid * 31 + k * 17) % 23 == 0 else 1 + (rid + k) % 3


def run(impl, setup: dict, ops: list[tuple], trace: Trace) -> None:
    def kv_manager():
        pool = KVPool(1, 1, 1, setup["num_slots"], page_size=setup["page_size"])   # slots only, no model
        return make_kv_manager(setup["cache"], pool, setup["max_requests"])

    options = {"in_batch_threshold": setup["in_batch_threshold"], "chunked_prefill": setup["chunked_prefill"]}
    args = (setup["max_batch_tokens"], setup["schedule"], (EOS,))
    ref = Scheduler(kv_manager(), *args, **options)
    kv = kv_manager()
    rows = "" if setup["max_requests"] == 256 else f", max_requests={setup['max_requests']}"
    trace.note(f"kv = make_kv_manager({setup['cache']!r}, KVPool(1, 1, 1, {setup['num_slots']}, "
               f"page_size={setup['page_size']}){rows})")
    part = trace.call(f"scheduler = {impl.__name__}(kv, {args[0]}, {args[1]!r}, eos_token_ids=({EOS},), "
                      f"in_batch_threshold={options['in_batch_threshold']}, "
                      f"chunked_prefill={options['chunked_prefill']})", impl, kv, *args, **options)
    pairs: list[tuple[Request, Request]] = []   # (reference's, part's) copy of each request
    prompts: list[list[int]] = []
    for trace.op, (op, seed) in enumerate(ops):
        rng = random.Random(seed)
        if op == "add":
            prompt = _prompt(rng, prompts)
            n, page, rid = rng.randint(1, 6), setup["page_size"], len(pairs)
            mine, theirs = Request(rid, prompt, n, page), Request(rid, prompt, n, page)
            if not ref.kv.fits(theirs):
                continue   # the engine refuses it before the scheduler sees it
            prompts.append(prompt)
            ref.add(theirs)
            trace.call(f"scheduler.add(Request({rid}, {prompt}, max_new_tokens={n}, page_size={page}))",
                       part.add, mine)
            pairs.append((theirs, mine))
        elif op == "step" and ref.has_unfinished():
            _step(ref, part, pairs, trace)
        elif op == "drain":
            limit = ref.num_steps + 200
            while ref.has_unfinished() and ref.num_steps < limit:
                _step(ref, part, pairs, trace)
            _end(kv, part, pairs, trace)


def _prompt(rng: random.Random, prompts: list[list[int]]) -> list[int]:
    """1-8 tokens, or an earlier prompt's head (sometimes all of it) and 0-4 tokens more."""
    if prompts and rng.random() < 0.6:
        earlier = rng.choice(prompts)
        head = earlier[:rng.randint(1, len(earlier))]
        return head + [rng.randint(1, 3) for _ in range(rng.randint(0 if len(head) > 1 else 1, 4))]
    return [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]


def _step(ref: Scheduler, part, pairs: list, trace: Trace) -> None:
    expected_batch = ref.schedule()
    expected = ref.report
    where = f"step {expected.step}"
    try:
        batch = trace.call("batch = scheduler.schedule()", part.schedule)
    except Raised as raised:   # which rule led there: a preemption of the wrong request, or a step out of order
        got = getattr(part, "report", None)
        if isinstance(raised.error, NotImplementedError) or not expected.preempted:
            raise
        hint = "preempt" if getattr(got, "preempted", None) != expected.preempted else "phases"
        raise Broken(f"{where}: scheduler.schedule() raised {describe(raised.error)}\n  the reference's step: "
                     f"{expected!r}\n  your step so far:     {got!r}", HINTS[hint]) from raised.error
    if batch is None:
        raise Broken("schedule() returned None (a stub?): it must return the step's Batch", HINTS["batch"])
    got = trace.call("scheduler.report", lambda: part.report, quiet=True)
    trace.answer(repr(got))
    for field, hint in DECISIONS:
        if getattr(got, field, None) != getattr(expected, field):
            hint = hint or _admission_hint(expected, got)
            _same(f"{where}, {field}", getattr(expected, field), getattr(got, field, None), expected, got, HINTS[hint])
    want = [(r.rid, len(ids)) for r, ids in zip(expected_batch.requests, expected_batch.input_ids, strict=True)]
    have = [(r.rid, len(ids)) for r, ids in zip(batch.requests, batch.input_ids, strict=False)]   # a part's answer
    _same(f"{where}, the batch's (rid, tokens computed)", want, have, expected, got, HINTS["batch"])
    _same(f"{where}, batch.num_prefills", expected_batch.num_prefills, batch.num_prefills, expected, got,
          HINTS["batch"])
    _same(f"{where}, the batch's slots", [s.tolist() for s in expected_batch.kv_indices],
          [s.tolist() for s in batch.kv_indices], expected, got, HINTS["batch"])
    for field in ("evicted_tokens", "used_slots", "evictable_slots", "free_slots"):
        _same(f"{where}, report.{field}", getattr(expected, field), getattr(got, field, None), expected, got,
              HINTS["decode"])
    tokens = [token(r.rid, len(r.output_ids)) for r in expected_batch.requests]
    ref.postprocess(expected_batch, tokens)
    trace.call(f"scheduler.postprocess(batch, {tokens})", part.postprocess, batch, tokens, quiet=True)
    _same(f"{where}, report.finished", ref.report.finished, getattr(part.report, "finished", None), ref.report,
          part.report, HINTS["base"])
    _same(f"{where}, the waiting queue (rids, first in line first)", [r.rid for r in ref.waiting],
          [r.rid for r in part.waiting], ref.report, part.report, HINTS["preempt"])
    _same(f"{where}, the running requests (rids, in admission order)", [r.rid for r in ref.running],
          [r.rid for r in part.running], ref.report, part.report, HINTS["admit"])
    _same(f"{where}, the requests' statuses", [str(t.status) for t, _ in pairs], [str(m.status) for _, m in pairs],
          ref.report, part.report, HINTS["base"])
    _same(f"{where}, stats", ref.stats, part.stats, ref.report, part.report, HINTS["base"])


def _admission_hint(expected, got) -> str:
    """The rule of admissions that differ from the referee's: none in a step that preempted; past
    the point where the referee stopped, the rule it stopped by (`expected.stopped`); else deferral,
    the tokens started, or the order."""
    if expected.preempted:
        return "preempted"
    prefills, deferred = getattr(got, "prefills", None), getattr(got, "deferred", None)
    if not (isinstance(deferred, list) and isinstance(prefills, list)
            and all(isinstance(p, tuple) and len(p) == 3 for p in prefills)):
        return "base"   # the report is SchedulerBase's: start() and report.deferred fill it
    tried = {rid for rid, _, _ in expected.prefills} | set(expected.deferred)
    if expected.stopped and ({rid for rid, _, _ in prefills} | set(deferred)) - tried:
        return expected.stopped
    if deferred != expected.deferred:
        return "defer"
    return "admit" if [p[0] for p in prefills] == [p[0] for p in expected.prefills] else "order"


def _same(what: str, expected, got, expected_report, got_report, hint: str) -> None:
    if got != expected:
        raise Broken(f"{what}: expected {expected!r}, got {got!r}\n  the reference's step: {expected_report!r}\n"
                     f"  your step:            {got_report!r}", hint)


def _end(kv, part, pairs: list, trace: Trace) -> None:
    """Every request finished with the reference's tokens; with the cache evicted, every slot free."""
    if trace.call("scheduler.has_unfinished()", part.has_unfinished, quiet=True):
        raise Broken("the reference has served every request, but scheduler.has_unfinished() is True",
                     HINTS["admit"])
    for theirs, mine in pairs:
        if mine.token_ids != theirs.token_ids:
            raise Broken(f"r{mine.rid}'s tokens: expected {theirs.token_ids}, got {mine.token_ids}", HINTS["base"])
    trace.note("kv.evict_all()")
    kv.evict_all()
    if kv.free_slots != kv.capacity or kv.rows.num_free != len(kv.rows.lengths):
        raise Broken(f"after every request finished and evict_all(): {kv.free_slots} of {kv.capacity} slots free, "
                     f"{kv.rows.num_free} of {len(kv.rows.lengths)} rows: every slot and row must be free",
                     HINTS["base"])
