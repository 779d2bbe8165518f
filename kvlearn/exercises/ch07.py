"""Chapter 7 exercises: diagnose and tune cache_aware's thresholds for a hot tenant, write a routing
policy, size a cache for real traffic, and measure what routing recovers of a pooled cache."""

from functools import cache
from numbers import Integral

from kvlearn.exercises import attempt, given, report

NUM_REPLICAS = 6


@cache
def _hot_trace():
    from kvlearn.routing.traces import multi_tenant_trace

    return tuple(multi_tenant_trace(600, num_tenants=16, output_tokens=(8, 48), rate=8, hot_tenant_share=0.5, seed=7))


@cache
def _baseline(policy: str):
    from kvlearn.routing.fleet import simulate_fleet

    return simulate_fleet(list(_hot_trace()), policy, NUM_REPLICAS, slots_per_replica=8192)


BRANCHES = ("imbalanced", "cache_hit", "low_match")   # the branches of the rule, as `decisions` names them


def check_thresholds(cache_threshold, balance_abs_threshold, balance_rel_threshold, branch=None) -> bool:
    """Exercise 1: first the diagnosis, `branch`: which branch of cache_aware's rule should have
    sent more of the hot tenant's requests elsewhere ("imbalanced"; None skips the question). Then
    thresholds for cache_aware on the hot-tenant trace (600 requests, 6 replicas) that keep its hit
    rate at least 10 points above least_load's AND its load imbalance within 0.10 of least_load's
    (kvlearn's defaults, 0.3 / 8 / 1.5, miss the second)."""
    from kvlearn.routing.fleet import simulate_fleet

    if any(x is ... or x is None for x in (cache_threshold, balance_abs_threshold, balance_rel_threshold)):
        return report(False, "give three numbers: cache_threshold in [0, 1], balance_abs_threshold >= 0 "
                             "(requests), balance_rel_threshold >= 1.")
    if branch is not None and branch != "imbalanced":
        if branch not in BRANCHES:
            return report(False, f"branch must be one of {', '.join(map(repr, BRANCHES))} (the keys of "
                                 f"result.router['decisions']), got {branch!r}.")
        return report(False, {
            "cache_hit": "'cache_hit' sends a request where its prefix is cached: "
                         "that is what piles the hot tenant onto "
                         "one replica, not what should have moved it off. Which branch is checked first?",
            "low_match": "'low_match' fires only when no replica holds enough of the prefix: the hot tenant's replica "
                         "does hold it. Which branch is checked first, and when does it fire?"}[branch])
    shown = given(cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
                  balance_rel_threshold=balance_rel_threshold)
    try:
        result = simulate_fleet(list(_hot_trace()), "cache_aware", NUM_REPLICAS, slots_per_replica=8192,
                                cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
                                balance_rel_threshold=balance_rel_threshold)
    except Exception as e:   # thresholds the policy refuses: say which, and why
        return report(False, f"{shown}: {type(e).__name__}: {e}")
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
    policy, error = attempt(policy_class, NUM_REPLICAS, shown=given(num_replicas=NUM_REPLICAS))
    if error or not isinstance(policy, Policy):
        return report(False, error or "policy_class(num_replicas) must return a kvlearn Policy (subclass Policy).")
    where = {}   # session -> replicas its turns went to

    def routed(req, replica, inner=policy.routed):
        where.setdefault(req.session, set()).add(replica)
        inner(req, replica)

    policy.routed = routed
    result, error = attempt(lambda: simulate_fleet(trace, policy, NUM_REPLICAS),
                            shown=f"routing a multi-turn trace of {len(trace)} requests over {NUM_REPLICAS} replicas")
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


@cache
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
    answer, error = attempt(capacity_for, trace, 0.9,
                            shown=f"trace=the bundled synthetic Mooncake trace ({len(trace):,} requests), share=0.9")
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
                             "(bisect between a capacity that misses and one that reaches, "
                             "until they are within 10 %).")
    return report(True, "")


@cache
def reference_routing_rates(replicas: int, slots: int) -> tuple[float, float, float]:
    """The hit rates `check_routing_share` compares with (exercise 4): round robin, cache-aware and a
    pooled fleet (least_load with `pool_tokens = replicas * slots`) on the first 200 requests of
    section 4's trace, `replicas` replicas of `slots` slots."""
    from kvlearn.routing.fleet import simulate_fleet

    trace = _pooled_trace()
    rr, aware = (simulate_fleet(trace, p, replicas, slots_per_replica=slots).hit_rate
                 for p in ("round_robin", "cache_aware"))
    pooled = simulate_fleet(trace, "least_load", replicas, slots_per_replica=slots,
                            pool_tokens=replicas * slots).hit_rate
    return rr, aware, pooled


def _pooled_trace():
    from kvlearn.routing.traces import multi_tenant_trace

    return multi_tenant_trace(600, num_tenants=32, output_tokens=(8, 48), rate=10, seed=0)[:200]


def check_routing_share(routing_share) -> bool:
    """Exercise 4: `routing_share(trace, replicas, slots)` returns the share of a pooled cache's
    hit-rate gain over round robin that cache-aware routing on local caches recovers:
    (cache_aware - round_robin) / (pooled - round_robin), the pooled fleet being `least_load` with
    `pool_tokens = replicas * slots`. Checked on the first 200 requests of chapter 7's section-4
    trace, 4 replicas of 3,072 slots, within 0.01."""
    replicas, slots = 4, 3072
    answer, error = attempt(routing_share, _pooled_trace(), replicas, slots,
                            shown=f"trace=the first 200 requests of section 4's trace, "
                                  f"{given(replicas=replicas, slots=slots)}")
    if error:
        return report(False, error)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return report(False, f"routing_share must return a number (a share, e.g. 0.5), got {answer!r}.")
    rr, aware, pooled = reference_routing_rates(replicas, slots)
    want = (aware - rr) / (pooled - rr)
    if abs(answer - want) <= 0.01:
        return report(True, "")
    if abs(answer - (aware - rr) / pooled) <= 0.01 or abs(answer - aware / pooled) <= 0.01:
        return report(False, f"{answer:.3f}: measure both gains from round robin's hit rate ({rr:.1%}), the "
                             "baseline that neither routing nor a pool is needed for.")
    if abs(answer - 1 / want) <= 0.01:
        return report(False, f"{answer:.3f}: that is the pool's gain over routing's; the share is routing's gain "
                             "over the pool's.")
    return report(False, f"{answer:.3f}: check the three runs (round_robin, cache_aware, and least_load with a pool of "
                         "replicas x slots tokens) on the same trace, replicas and slots.")
