"""Chapter 6's referee names the rule a wrong scheduler broke, not the one it followed: each known
wrong turn fails `check("scheduler", ...)` with a first hint line that states the right rule (the
referee's admission replayed in its own order against the part's decisions)."""

import pytest

from kvlearn.parts import SchedulerPart, check
from tests.test_part_scheduler import MyScheduler


def admissions(order):
    """An admission loop whose rules run in `order` (names: "budget", "wait", "defer", "start")."""

    def admit(self, budget):
        admitted = []
        for req, cached in self.order():
            verdict = None
            for rule in order:
                if rule == "budget" and budget <= 0:
                    verdict = "stop"
                elif rule == "wait" and not self.chunked_prefill and len(req.token_ids) - cached > budget \
                        and (admitted or self.running):
                    verdict = "stop"
                elif rule == "defer" and self.shares_in_batch(req, cached):
                    self.report.deferred.append(req.rid)
                    verdict = "next"
                elif rule == "start":
                    n = self.start(req, budget)
                    verdict = "stop" if n is None else "next"
                    if n is not None:
                        admitted.append((req, n))
                        budget -= n
                if verdict:
                    break
            if verdict == "stop":
                break
        return admitted

    return admit


class DefersBeforeTheNoChunkRule(MyScheduler):   # the wrong turn of issue 29: step 8, deferred [4]
    admissions = admissions(["budget", "defer", "wait", "start"])


class DefersFirst(MyScheduler):
    admissions = admissions(["defer", "budget", "wait", "start"])


class PreemptsTheOldest(MyScheduler):
    def make_room(self, req):
        victim = self.running[0]
        self.preempt(victim)
        return victim is not req


class ChunksBeforeDecodes(MyScheduler):
    """Takes the chunks out of the whole budget, before the decodes (and their preemptions)."""

    def schedule(self):
        self.begin_step()
        budget, chunks = self.max_batch_tokens, []
        for req in self.running:
            if req.prefilling and budget > 0:
                chunks.append((req, min(req.prefill_len - req.num_computed, budget)))
                budget -= chunks[-1][1]
        decodes = self.decodes()
        prefills = self.admissions(budget - len(decodes)) if not self.report.preempted else []
        return self.form_batch(prefills, chunks, decodes)


class AdmitsAfterAPreemption(MyScheduler):
    def schedule(self):
        self.begin_step()
        decodes = self.decodes()
        budget, chunks = self.max_batch_tokens - len(decodes), []
        for req in self.running:
            if req.prefilling and budget > 0:
                chunks.append((req, min(req.prefill_len - req.num_computed, budget)))
                budget -= chunks[-1][1]
        return self.form_batch(self.admissions(budget), chunks, decodes)


class GoesOnWhenThePoolIsFull(MyScheduler):
    def admissions(self, budget):
        admitted = []
        for req, cached in self.order():
            if budget <= 0 or (not self.chunked_prefill and len(req.token_ids) - cached > budget
                               and (admitted or self.running)):
                break
            if self.shares_in_batch(req, cached):
                self.report.deferred.append(req.rid)
                continue
            n = self.start(req, budget)
            if n is not None:        # should stop: a later, smaller request jumps the line
                admitted.append((req, n))
                budget -= n
        return admitted


WRONG = [
    (DefersBeforeTheNoChunkRule, "deferred: expected", ["without chunked prefill", "comes before deferral",
                                                        "must wait anyway is not deferred"]),
    (DefersFirst, "deferred: expected", ["budget is spent", "comes before deferral", "is not deferred"]),
    (PreemptsTheOldest, "preempted r", ["preempt the newest running request (self.running[-1]"]),
    (ChunksBeforeDecodes, "step", ["chunks, after the decodes"]),
    (AdmitsAfterAPreemption, "prefills: expected []", ["a step that preempted admits nobody"]),
    (GoesOnWhenThePoolIsFull, "prefills: expected", ["returns None when the pool cannot hold req",
                                                      "stops admission"]),
]


@pytest.mark.parametrize("impl, what, rule", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_a_wrong_scheduler_is_told_the_rule_it_broke(impl, what, rule):
    report = check("scheduler", impl)
    assert not report.passed and what in report.message, report.message
    hint = next(line for line in report.message.splitlines() if line.startswith("Hint: "))
    for words in rule:
        assert words in hint, report.message


def test_the_issue_s_wrong_turn_is_no_longer_told_to_defer():
    report = check("scheduler", DefersBeforeTheNoChunkRule)
    hint = next(line for line in report.message.splitlines() if line.startswith("Hint: "))
    assert "shares_in_batch" not in hint and "is deferred" not in hint.replace("is not deferred", ""), hint


def test_the_contract_states_the_rules_in_the_referee_s_order_with_the_fields_they_use():
    doc = SchedulerPart.__doc__
    steps = [doc.index(words) for words in ("1. Decodes", "2. Chunks", "3. Admissions", "a. stop if the budget",
                                            "b. stop, without chunked prefill", "c. only then", "d. `start(")]
    assert steps == sorted(steps)
    for field in ("req.prefill_len", "req.num_computed", "req.prefilling", "must wait anyway"):
        assert field in doc
