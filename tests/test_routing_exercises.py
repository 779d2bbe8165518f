"""Chapter 7 exercises: the checkers accept the worked solutions, answer the student stubs and
wrong answers with "Not yet" and a hint, and never raise."""

from pathlib import Path

import nbformat
import pytest

from kvlearn.exercises import NOT_YET, OK, ch07
from kvlearn.routing.policies import LeastLoad, Policy, RoundRobin
from kvlearn.routing.replay import replay
from kvlearn.workshop.student import student_copy
from tests.test_exercise_hints import own_hints

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "07_routing.ipynb"


class Sticky(Policy):
    def __init__(self, num_replicas):
        self.home = {}

    def choose(self, req, view):
        return self.home.get(req.session, view.least_loaded())

    def routed(self, req, replica):
        self.home.setdefault(req.session, replica)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_thresholds_checker(capsys):
    assert ch07.check_thresholds(0.3, 4, 1.5)
    assert ch07.check_thresholds(0.3, 4, 1.5, "imbalanced")
    assert not ch07.check_thresholds(0.3, 8, 1.5)         # the defaults leave the hot tenant too heavy
    assert not ch07.check_thresholds(..., ..., ...)
    out = capsys.readouterr().out
    assert out.count(OK) == 2 and out.count(NOT_YET) == 2 and "piles up" in out
    own_hints(capsys, ch07.check_thresholds, [   # each likely mistake, a hint of its own
        ((0.3, 4, 1.5, "cache_hit"), "piles the hot tenant"),     # the diagnosis comes first
        ((0.3, 4, 1.5, "low_match"), "no replica holds"),
        ((0.3, 4, 1.5, "hot"), "must be one of"),
        ((0.3, 0, 1.0), "Raise the balance"),                      # always balancing: affinity is lost
        ((0.3, 10**9, 1.5), "Lower balance_abs_threshold"),        # no balancing: the hot tenant piles up
        ((2.0, 4, 1.5), "cache_threshold must be in")])            # out of range: a hint, not a crash


def test_policy_checker(capsys):
    assert ch07.check_policy(Sticky)
    assert not ch07.check_policy(lambda n: RoundRobin())   # splits sessions
    assert not ch07.check_policy(lambda n: LeastLoad())
    assert not ch07.check_policy(lambda n: "not a policy")
    out = capsys.readouterr().out
    assert out.count(OK) == 1 and out.count(NOT_YET) == 3 and "split" in out


def capacity_for(trace, share):
    target = share * replay(trace).hit_rate
    low, high = 10**4, 10**9
    while high > 1.1 * low:
        mid = int((low * high) ** 0.5)
        low, high = (low, mid) if replay(trace, mid).hit_rate >= target else (mid, high)
    return high


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_capacity_checker(capsys):
    assert ch07.check_capacity(capacity_for)
    assert not ch07.check_capacity(lambda trace, share: 3_000_000)       # too small
    assert not ch07.check_capacity(lambda trace, share: 10**9)           # enough, but far from the smallest
    assert not ch07.check_capacity(lambda trace, share: None)
    out = capsys.readouterr().out
    assert out.count(OK) == 1 and out.count(NOT_YET) == 3 and "search higher" in out and "lower" in out


def routing_share(trace, replicas, slots):
    from kvlearn.routing.fleet import simulate_fleet

    rr, aware = (simulate_fleet(trace, p, replicas, slots_per_replica=slots).hit_rate
                 for p in ("round_robin", "cache_aware"))
    pooled = simulate_fleet(trace, "least_load", replicas, slots_per_replica=slots,
                            pool_tokens=replicas * slots).hit_rate
    return (aware - rr) / (pooled - rr)


@pytest.mark.slow   # six fleets of 200 requests: about 8 s
def test_routing_share_checker(capsys):
    rr, aware, pooled = ch07.reference_routing_rates(4, 3072)
    assert rr < aware < pooled                                 # routing recovers part of the pool's gain
    assert ch07.check_routing_share(routing_share)
    assert not ch07.check_routing_share(lambda t, r, s: (aware - rr) / pooled)   # forgot the baseline
    assert not ch07.check_routing_share(lambda t, r, s: (pooled - rr) / (aware - rr))   # upside down
    assert not ch07.check_routing_share(lambda t, r, s: 0.0)
    assert not ch07.check_routing_share(lambda t, r, s: None)
    out = capsys.readouterr().out
    assert out.count(OK) == 1 and out.count(NOT_YET) == 4 and "baseline" in out and "upside" not in out


def test_student_stubs_get_not_yet(capsys):
    student = student_copy(nbformat.read(NOTEBOOK, as_version=4))
    namespace = {}
    for cell in student.cells:
        if cell.cell_type == "code" and "your " in cell.source:
            exec(cell.source, namespace)
    out = capsys.readouterr().out
    assert out.count(NOT_YET) == 4 and OK not in out
