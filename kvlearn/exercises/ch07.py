"""Chapter 7 exercises: tune cache_aware's thresholds for a hot tenant, write a routing policy, and
size a cache for real traffic."""

from functools import lru_cache
from numbers import Integral

from kvlearn.exercises import attempt, report

NUM_REPLICAS = 6


@lru_cache(maxsize=None)
def _hot_trace():
    from kvlearn.routing.traces import multi_tenant_trace

    return tuple(multi_tenant_trace(600, num_tenants=16, output_tokens=(8, 48), rate=8, hot_tenant_share=0.5, seed=7))


@lru_cache(maxsize=None)
def _baseline(policy: str):
    from kvlearn.routing.fleet import simulate_fleet

    return simulate_fleet(list(_hot_trace()), policy, NUM_REPLICAS, slots_per_replica=8192)


def check_thresholds(cache_threshold, balance_abs_threshold, balance_rel_threshold) -> bool:
    """Exercise 1: thresholds for cache_aware on the hot-tenant trace (600 requests, 6 replicas)
    that keep its hit rate at least 10 points above least_load's AND its load imbalance within
    0.10 of least_load's (kvlearn's defaults, 0.3 / 8 / 1.5, miss the second)."""
    from kvlearn.routing.fleet import simulate_fleet

    if any(x is ... or x is None for x in (cache_threshold, balance_abs_threshold, balance_rel_threshold)):
        return report(False, "give three numbers: cache_threshold in [0, 1], balance_abs_threshold >= 0 "
                             "(requests), balance_rel_threshold >= 1.")
    result, error = attempt(lambda: simulate_fleet(
        list(_hot_trace()), "cache_aware", NUM_REPLICAS, slots_per_replica=8192, cache_threshold=cache_threshold,
        balance_abs_threshold=balance_abs_threshold, balance_rel_threshold=balance_rel_threshold))
    if error:
        return report(False, error)
    least = _baseline("least_load")
    if result.hit_rate < least.hit_rate + 0.10:
        return report(False, f"hit rate {result.hit_rate:.1%} vs least_load's {least.hit_rate:.1%}: affinity gave up "
                             "too often. Raise the balance thresholds, or lower cache_threshold.")
    if result.load_imbalance > least.load_imbalance + 0.10:
        return report(False, f"load imbalance {result.load_imbalance:.2f} vs least_load's {least.load_imbalance:.2f}: "
                             "the hot tenant piles up. Lower balance_abs_threshold or balance_rel_threshold.")
    return report(True, "")


def check_policy(policy_class) -> bool:
    """Exercise 2: `policy_class(num_replicas)` is a Policy that keeps every turn of a session on one
    replica (sticky sessions) and sends a session's first turn to the least loaded replica. On a
    multi-turn trace it must keep sessions whole and beat round_robin's hit rate by 10 points."""
    from kvlearn.routing.fleet import simulate_fleet
    from kvlearn.routing.policies import Policy
    from kvlearn.routing.traces import multi_tenant_trace

    trace = multi_tenant_trace(300, num_tenants=4, system_tokens=(40, 80), output_tokens=(8, 48), mean_turns=4, rate=3,
                               seed=11)
    policy, error = attempt(policy_class, NUM_REPLICAS)
    if error or not isinstance(policy, Policy):
        return report(False, error or "policy_class(num_replicas) must return a kvlearn Policy (subclass Policy).")
    where = {}   # session -> replicas its turns went to

    def routed(req, replica, inner=policy.routed):
        where.setdefault(req.session, set()).add(replica)
        inner(req, replica)

    policy.routed = routed
    result, error = attempt(lambda: simulate_fleet(trace, policy, NUM_REPLICAS))
    if error:
        return report(False, error + " (choose must return a replica index in range(view.num_replicas)).")
    split = [s for s, replicas in where.items() if len(replicas) > 1]
    if split:
        return report(False, f"{len(split)} sessions were split across replicas, e.g. {split[0]!r}: remember where "
                             "each session went (in `routed`) and send its next turns there.")
    baseline = simulate_fleet(trace, "round_robin", NUM_REPLICAS)
    if result.hit_rate < baseline.hit_rate + 0.10:
        return report(False, f"hit rate {result.hit_rate:.1%}, round_robin {baseline.hit_rate:.1%}: send new sessions "
                             "where the load is lowest (view.least_loaded()).")
    return report(True, "")


@lru_cache(maxsize=None)
def _synthetic():
    from kvlearn.routing.mooncake import mooncake_trace_path, read_mooncake
    from kvlearn.routing.replay import replay

    trace = read_mooncake(mooncake_trace_path("synthetic"))
    return trace, replay(trace).hit_rate


def check_capacity(capacity_for) -> bool:
    """Exercise 3: `capacity_for(trace, share)` returns the smallest cache capacity, in tokens and
    within 10 %, at which an LRU replay of the Mooncake `trace` reaches `share` of its unbounded
    hit rate. Checked on the bundled synthetic trace at share 0.9: the answer C must reach it and
    C / 1.1 must not."""
    from kvlearn.routing.replay import replay

    trace, best = _synthetic()
    answer, error = attempt(capacity_for, trace, 0.9)
    if error:
        return report(False, error)
    if isinstance(answer, bool) or not isinstance(answer, Integral) or answer < 0:
        return report(False, f"capacity_for must return a number of tokens (an int >= 0), got {answer!r}.")
    target, answer = 0.9 * best, int(answer)
    reached = replay(trace, answer).hit_rate
    if reached < target:
        return report(False, f"{answer:,} tokens give a hit rate of {reached:.1%}, under 90 % of the unbounded "
                             f"{best:.1%}: search higher.")
    smaller = int(answer / 1.1)
    if replay(trace, smaller).hit_rate >= target:
        return report(False, f"{smaller:,} tokens already reach 90 % of {best:.1%}: the smallest capacity is lower "
                             "(bisect between a capacity that misses and one that reaches, until they are within 10 %).")
    return report(True, "")
