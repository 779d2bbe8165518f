"""A fleet: N engine replicas behind a router, simulated in virtual time.

Each replica is chapter 6's scheduler and KV manager, unchanged. `SimReplica` runs them on a
slots-only pool without the model (every request "generates" the answer its trace recorded, then
a filler token); `EngineReplica` wraps a real `Engine`. The same event loop drives both, so the
router sees the same fleet and makes the same decisions:

- requests arrive at their trace times; the policy picks a replica from a `RouterView` (requests
  in flight, outstanding tokens, and for `exact` the replicas' real caches) and the request joins
  that replica's waiting queue;
- an idle replica with work starts a step: its scheduler forms the batch, and the step lasts what
  the time model says for that batch's prefill tokens, decodes and context; when it ends, first
  tokens count toward time to first token (TTFT) and finished requests leave.

Most steps of a fleet are plain decode steps: each running request gets one token and nothing else
happens. A `SimReplica` runs a stretch of them (no request waiting, none finishing, room in the
pool) in one `advance` call, as many scheduler steps would (the same slots, evictions, stats);
the loop still times each step and updates the router's view after each, and an arrival at the
replica ends the stretch after the step in progress. The result is the step-by-step one
(`fast_forward=False` checks it), at a fraction of the cost: a scheduler step costs a tenth of a
millisecond of Python, and a fleet runs millions of them.

Invariants checked at the end: every request finished, and each replica's prompt tokens equal its
cached plus computed prefill tokens when nothing was preempted.
"""

from __future__ import annotations

import heapq
import statistics
import time
from dataclasses import dataclass, field
from itertools import chain

from kvlearn.errors import KVCapacityError, check_positive_int
from kvlearn.pool import KVPool
from kvlearn.routing.policies import Policy, RouterView
from kvlearn.routing.timemodel import TimeModel, default_time_model
from kvlearn.routing.traces import TraceRequest, unique_token_floor
from kvlearn.serving.cache_modes import CACHE_MODES, NoCacheKV, RadixKV, default_page_size, make_kv_manager
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler, StepReport

FILLER_TOKEN = 0  # what a simulated request generates past its recorded answer; generated traces never use it
# KV managers whose decode steps `SimReplica.advance` can run many at once: their `after_forward`
# does nothing for a decode, so a decode step only grows slots
FAST_KV = (RadixKV, NoCacheKV)


class SimReplica:
    """A replica without the model: a real Scheduler and KV manager on a pool of bare slots."""

    def __init__(self, cache: str = "radix", num_slots: int = 16384, page_size: int | None = None,
                 max_batch_tokens: int = 2048, schedule: str = "fcfs", max_running: int | None = None):
        page_size = default_page_size(cache) if page_size is None else page_size
        pool = KVPool(1, 1, 1, num_slots, page_size=page_size, device="cpu")
        # max_running: requests that may run at once (rows of the KV manager's request table);
        # None keeps the engine's default, which real-engine comparisons need
        self.kv = make_kv_manager(cache, pool) if max_running is None else make_kv_manager(cache, pool, max_running)
        self.scheduler = Scheduler(self.kv, max_batch_tokens=max_batch_tokens, schedule=schedule)
        self.page_size = page_size
        self.answers: dict[int, tuple[int, ...]] = {}   # rid -> recorded answer

    def submit(self, rid: int, treq: TraceRequest) -> Request:
        req = Request(rid, treq.prompt_ids, treq.max_new_tokens, page_size=self.page_size)
        self.answers[rid] = treq.answer
        self.scheduler.add(req)
        return req

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that got a token."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("The scheduler found nothing to run although requests wait: a kvlearn bug.")
        tokens, before = [], []
        for req in batch.requests:
            answer, k = self.answers[req.rid], len(req.token_ids) - req.num_prompt_tokens
            tokens.append(answer[k] if k < len(answer) else FILLER_TOKEN)
            before.append(len(req.token_ids))
        for req in self.scheduler.postprocess(batch, tokens):
            del self.answers[req.rid]
        # a chunk of a long prompt that is not its last one gets no token yet
        return [req for req, n in zip(batch.requests, before) if len(req.token_ids) > n]

    def decode_run(self) -> tuple[int, bool]:
        """How many of the next steps are plain decode steps that nothing inside the replica can
        change (no request waits, every running one decodes and none finishes, and the pool has
        room for every new token, evicting cached tokens if need be), and whether they evict.
        (0, False) when the next step must go through the scheduler. An arrival can still cut the
        run short: the event loop then stops it early."""
        sched, kv = self.scheduler, self.kv
        running = sched.running
        if sched.waiting or not running or type(kv) not in FAST_KV or sched.eos_token_ids:
            return 0, False
        if any(req.num_computed < req.prefill_len or req.num_computed != len(req.token_ids) - 1 for req in running):
            return 0, False    # a prompt still in chunks (even with one token left) is not decoding
        # the step that brings a request to max_new_tokens finishes it: stop one before the first
        steps = min(req.max_new_tokens - (len(req.token_ids) - req.num_prompt_tokens) for req in running) - 1
        if steps <= 0:
            return 0, False
        steps = kv._rounds_with_room(running, steps)
        return steps, kv._round_pages(running, steps) * kv.page_size > kv.free_slots

    def advance(self, steps: int) -> None:
        """Run the next `steps` plain decode steps at once (all of them within `decode_run()`),
        with the very outcome of as many `step()` calls: the same tokens, slots, evictions,
        scheduler stats and last step report."""
        sched, kv = self.scheduler, self.kv
        running = sched.running
        evicted = kv._grow_rounds(running, steps)
        for req in running:
            k = len(req.token_ids) - req.num_prompt_tokens
            tokens = self.answers[req.rid][k:k + steps]
            req.token_ids.extend(tokens)
            if len(tokens) < steps:
                req.token_ids.extend([FILLER_TOKEN] * (steps - len(tokens)))
            req.num_computed = len(req.token_ids) - 1
        sched.num_steps += steps
        stats = sched.stats
        stats["steps"] += steps
        stats["output_tokens"] += steps * len(running)
        stats["evicted_tokens"] += sum(evicted)
        used = kv.slots_in_use(running)   # decode steps only add slots: the last step's count is the peak
        stats["peak_slots"] = max(stats["peak_slots"], used)
        sched.report = StepReport(sched.num_steps, decodes=[req.rid for req in running], evicted_tokens=evicted[-1],
                                  used_slots=used, evictable_slots=kv.evictable_slots, free_slots=kv.free_slots)
        kv.check(running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def waiting_prompts(self):
        """Prompts routed here that are not in the cache yet: waiting, or admitted and still being
        computed in chunks (a prompt joins the cache after its last chunk)."""
        sched = self.scheduler
        return chain((req.token_ids for req in sched.waiting),
                     (req.token_ids for req in sched.running if req.num_computed < req.prefill_len))

    @property
    def stats(self) -> dict:
        return self.scheduler.stats


class EngineReplica:
    """A replica running the real model: a kvlearn Engine (several may share one model object)."""

    def __init__(self, engine):
        self.engine, self.kv, self.page_size = engine, engine.kv, engine.pool.page_size
        self.live: list[Request] = []

    def submit(self, rid: int, treq: TraceRequest) -> Request:
        req = self.engine.add_request(treq.prompt_ids, treq.max_new_tokens)
        self.live.append(req)
        return req

    def step(self) -> list[Request]:
        before = [len(r.token_ids) for r in self.live]
        self.engine.step()
        progressed = [r for r, n in zip(self.live, before) if len(r.token_ids) > n]
        self.live = [r for r in self.live if r.status != "finished"]
        return progressed

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def waiting_prompts(self):
        return (req.token_ids for req in self.live
                if req.status == "waiting" or (req.status == "running" and req.num_computed < req.prefill_len))

    @property
    def stats(self) -> dict:
        return self.engine.stats


@dataclass
class FleetResult:
    """What a fleet run measured. `per_replica` has one dict per replica; times are simulated."""

    policy: str
    replicas: int
    requests: int
    prompt_tokens: int
    computed_prefill_tokens: int
    cached_tokens: int
    unique_token_floor: int
    hit_rate: float
    load_imbalance: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    makespan_s: float
    output_tokens: int
    preemptions: int
    wall_s: float
    per_replica: list[dict] = field(default_factory=list)
    router: dict = field(default_factory=dict)
    routes: dict = field(default_factory=dict)    # trace id -> replica it was sent to
    outputs: dict = field(default_factory=dict)   # trace id -> generated token ids (when kept)

    SUMMARY = ("policy", "replicas", "requests", "prompt_tokens", "computed_prefill_tokens", "unique_token_floor",
               "hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s")

    def summary(self) -> dict:
        """The fields `route --json` prints, plus the simulator's own cost."""
        row = {k: getattr(self, k) for k in self.SUMMARY}
        row.update(cached_tokens=self.cached_tokens, makespan_s=self.makespan_s, preemptions=self.preemptions,
                   sim_wall_s=round(self.wall_s, 3),
                   sim_requests_per_s=round(self.requests / self.wall_s, 1) if self.wall_s else None, **self.router)
        return row

    def __repr__(self) -> str:
        return (f"FleetResult({self.policy}, {self.replicas} replicas, {self.requests} requests: hit rate "
                f"{self.hit_rate:.1%}, imbalance {self.load_imbalance:.2f}, TTFT p50 {self.ttft_p50_s:.3f} s "
                f"p99 {self.ttft_p99_s:.3f} s)")


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n   # the first mismatch by bisection: list slices compare in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def known_prefix_len(replica, prompt: list[int]) -> int:
    """What a router fed by KV events knows a replica will have for `prompt` by the time it runs:
    its real cache (`cached_len`), or the prefix shared with a request routed there whose prompt is
    not cached yet, waiting or still computing in chunks (Dynamo's router counts its in-flight
    requests' blocks the same way)."""
    waiting = (_common_prefix_len(prompt[:-1], other) for other in replica.waiting_prompts())
    return max(replica.kv.cached_len(prompt), max(waiting, default=0))


def check_fits(trace: list[TraceRequest], replica) -> None:
    """Refuse a trace whose largest request could never fit in one replica's pool."""
    largest = max(trace, key=lambda r: r.num_prompt_tokens + r.max_new_tokens)
    probe = Request(-1, largest.prompt_ids, largest.max_new_tokens, page_size=replica.page_size)
    if not replica.kv.fits(probe):
        raise KVCapacityError(
            f"{largest.where} needs KV for {probe.max_tokens} tokens ({largest.num_prompt_tokens} prompt + "
            f"{largest.max_new_tokens} new - 1) but a replica's pool holds {replica.kv.capacity}: use more slots "
            f"per replica (--slots-per-replica), or drop that request.")


def run_fleet(trace: list[TraceRequest], policy: Policy, replicas: list, time_model: TimeModel | None = None,
              keep_outputs: bool = False, progress: bool = False, fast_forward: bool = True) -> FleetResult:
    """Serve `trace` (sorted by arrival) on `replicas` (SimReplica or EngineReplica) routed by `policy`.

    fast_forward: let a SimReplica run a stretch of plain decode steps (`decode_run`) as one
    `advance` call. The loop still times every step and updates the router's view after each, and
    an arrival at the replica ends the stretch after the step in progress, so the result is the
    same as stepping one by one (False does that, for checking)."""
    if not trace:
        raise ValueError("The trace is empty: give at least one request.")
    if not replicas:
        raise ValueError("A fleet needs at least one replica.")
    check_fits(trace, replicas[0])
    time_model = time_model or default_time_model()
    step_s = time_model.step_s
    heappush, heappop = heapq.heappush, heapq.heappop
    n = len(replicas)

    def cached_len(i: int, prompt: list[int]) -> int:   # what `exact` asks
        if stretch[i] is not None and stretch[i][6]:   # the stretch changes the cache: bring it up to now
            catch_up(i)
        return known_prefix_len(replicas[i], prompt)

    view = RouterView([0] * n, [0] * n, cached_len=cached_len)
    busy_s, routed = [0.0] * n, [0] * n
    running = [False] * n
    steps: list[tuple[float, int, int, list]] = []    # (end time, seq, replica, requests that got a token)
    owner: dict[int, TraceRequest] = {}               # id(Request) -> its trace request
    ttft, routes, outputs, done, seq, output_tokens = [], {}, {}, 0, 0, 0
    # a replica's stretch of plain decode steps: [requests decoding, their context before it, steps
    # done, steps it may run, whether an arrival cut it short, steps the replica has run, whether
    # the steps evict]; its steps go on the heap with None. The replica runs them when the stretch
    # ends, or, if they evict, as far as the step in progress when the router asks what it caches.
    stretch: list[list | None] = [None] * n
    can_stretch = [fast_forward and hasattr(rep, "decode_run") for rep in replicas]
    first_arrival = trace[0].arrival
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(trace), desc=f"route {policy.name}", unit="req", leave=False, mininterval=0.5)
    start_wall = time.perf_counter()

    def start_step(i: int, now: float) -> None:
        nonlocal seq
        if can_stretch[i]:
            planned, evicts = replicas[i].decode_run()
            if planned:
                batch = replicas[i].scheduler.running
                stretch[i] = [len(batch), sum(len(req.token_ids) for req in batch) - len(batch), 0, planned, False,
                              0, evicts]
                next_decode_step(i, now)
                return
        progressed = replicas[i].step()
        context = sum(len(req.token_ids) - 1 for req in progressed)
        decode = sum(len(req.token_ids) - req.num_prompt_tokens > 1 for req in progressed)
        stats = replicas[i].stats
        computed = stats["computed_prefill_tokens"] - last_computed[i]
        last_computed[i] = stats["computed_prefill_tokens"]
        duration = step_s(computed, decode, context)
        busy_s[i] += duration
        running[i] = True
        seq += 1
        heapq.heappush(steps, (now + duration, seq, i, progressed))

    def catch_up(i: int) -> None:
        """Run replica i's stretch up to the step in progress (scheduled when it started)."""
        s = stretch[i]
        if s[5] < s[2] + 1:
            replicas[i].advance(s[2] + 1 - s[5])
            s[5] = s[2] + 1

    def next_decode_step(i: int, now: float) -> None:
        """Time the next step of replica i's stretch: what `start_step` would for that step."""
        nonlocal seq
        s = stretch[i]
        duration = step_s(0, s[0], s[1] + s[0] * (s[2] + 1))   # each request's context grew by one per step
        busy_s[i] += duration
        running[i] = True
        seq += 1
        heapq.heappush(steps, (now + duration, seq, i, None))

    last_computed = [replicas[i].stats["computed_prefill_tokens"] for i in range(n)]
    next_arrival = 0
    now = first_arrival
    while next_arrival < len(trace) or steps:
        if next_arrival < len(trace) and (not steps or trace[next_arrival].arrival < steps[0][0]):
            treq = trace[next_arrival]
            next_arrival += 1
            now = treq.arrival
            i = policy.choose(treq, view)
            policy.routed(treq, i)
            routes[treq.id] = i
            req = replicas[i].submit(next_arrival - 1, treq)
            owner[id(req)] = treq
            routed[i] += 1
            view.inflight[i] += 1
            view.outstanding[i] += treq.num_prompt_tokens + treq.max_new_tokens
            if stretch[i] is not None:
                stretch[i][4] = True   # the request waits for the step in progress to end
            elif not running[i]:
                start_step(i, now)
            continue
        now, _, i, progressed = heappop(steps)
        if progressed is None:         # a step of a stretch: every request decoded one token
            s = stretch[i]
            s[2] += 1
            output_tokens += s[0]
            view.outstanding[i] -= s[0]
            if s[2] < s[3] and not s[4]:   # the next step of the stretch (next_decode_step, inlined)
                duration = step_s(0, s[0], s[1] + s[0] * (s[2] + 1))
                busy_s[i] += duration
                seq += 1
                heappush(steps, (now + duration, seq, i, None))
                continue
            if s[5] < s[2]:
                replicas[i].advance(s[2] - s[5])
            stretch[i] = None
            running[i] = False
            if replicas[i].has_unfinished():
                start_step(i, now)
            continue
        running[i] = False
        output_tokens += len(progressed)
        for req in progressed:
            treq = owner[id(req)]
            generated = len(req.token_ids) - req.num_prompt_tokens
            view.outstanding[i] -= 1 + (req.num_prompt_tokens if generated == 1 else 0)
            if generated == 1:
                ttft.append(now - treq.arrival)
            if req.status == "finished":
                del owner[id(req)]
                view.inflight[i] -= 1
                view.outstanding[i] -= treq.max_new_tokens - generated
                done += 1
                if keep_outputs:
                    outputs[treq.id] = req.token_ids[req.num_prompt_tokens:]
                if bar is not None and done % 256 == 0:
                    bar.update(256)
        if replicas[i].has_unfinished():
            start_step(i, now)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - start_wall
    assert done == len(trace) and not owner and not any(view.inflight), "requests left unfinished"

    per_replica = []
    for i, rep in enumerate(replicas):
        s = rep.stats
        per_replica.append({"replica": i, "requests": routed[i], "busy_s": round(busy_s[i], 4),
                            "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
                            "computed_prefill_tokens": s["computed_prefill_tokens"], "preemptions": s["preemptions"]})
    for r in per_replica:
        assert r["preemptions"] or r["prompt_tokens"] == r["cached_tokens"] + r["computed_prefill_tokens"], \
            f"replica {r['replica']}: prompt tokens are not cached + computed: {r}"
    total = {k: sum(r[k] for r in per_replica) for k in ("prompt_tokens", "cached_tokens", "computed_prefill_tokens",
                                                          "preemptions")}
    makespan = now - first_arrival
    prefill = total["cached_tokens"] + total["computed_prefill_tokens"]
    mean_busy = sum(busy_s) / n
    router = policy.tree_stats() if hasattr(policy, "tree_stats") else {}
    if hasattr(policy, "decisions"):
        router = {**router, "decisions": dict(policy.decisions)}
    return FleetResult(
        policy=policy.name, replicas=n, requests=len(trace), prompt_tokens=total["prompt_tokens"],
        computed_prefill_tokens=total["computed_prefill_tokens"], cached_tokens=total["cached_tokens"],
        unique_token_floor=unique_token_floor(trace),
        hit_rate=round(total["cached_tokens"] / prefill, 4) if prefill else 0.0,
        load_imbalance=round(max(busy_s) / mean_busy, 3) if mean_busy else 1.0,
        ttft_p50_s=round(_percentile(ttft, 50), 4), ttft_p99_s=round(_percentile(ttft, 99), 4),
        throughput_tok_s=round(output_tokens / makespan, 1) if makespan else 0.0, makespan_s=round(makespan, 3),
        output_tokens=output_tokens, preemptions=total["preemptions"], wall_s=wall, per_replica=per_replica,
        router=router, routes=routes, outputs=outputs)


def simulate_fleet(trace: list[TraceRequest], policy, num_replicas: int, cache: str = "radix",
                   slots_per_replica: int = 16384, page_size: int | None = None, time_model: TimeModel | None = None,
                   max_batch_tokens: int = 2048, schedule: str = "fcfs", max_running: int = 64,
                   progress: bool = False, fast_forward: bool = True, **policy_options) -> FleetResult:
    """Simulate `trace` on `num_replicas` model-free replicas; `policy` is a name or a Policy.
    page_size: tokens per page of each replica's pool (default: the cache mode's). max_running:
    requests a replica runs at once (each holds a row of max context length: memory grows with it).
    fast_forward: see `run_fleet` (the same result either way, only faster)."""
    from kvlearn.routing.policies import make_policy

    check_positive_int("num_replicas", num_replicas, " (replicas in the fleet)")
    check_positive_int("slots_per_replica", slots_per_replica, " (KV slots per replica)")
    if cache not in CACHE_MODES:
        raise ValueError(f"Unknown cache {cache!r}: choose one of {', '.join(CACHE_MODES)}.")
    if policy == "cache_aware":   # by default the router's guess of a replica is as big as its pool
        policy_options.setdefault("max_tree_pages", slots_per_replica // policy_options.get("tree_page_size", 16) or 1)
    if isinstance(policy, str):
        policy = make_policy(policy, num_replicas, **policy_options)
    replicas = [SimReplica(cache, slots_per_replica, page_size, max_batch_tokens, schedule, max_running)
                for _ in range(num_replicas)]
    return run_fleet(trace, policy, replicas, time_model, progress=progress, fast_forward=fast_forward)
