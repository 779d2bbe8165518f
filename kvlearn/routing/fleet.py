"""A fleet: N engine replicas behind a router, simulated in virtual time.

Each replica is chapter 6's scheduler and KV manager, unchanged: a model-free `SimReplica` or an
`EngineReplica` around a real `Engine` (`kvlearn.routing.replicas`). The same event loop
(`FleetLoop`) drives both, so the router sees the same fleet and makes the same decisions:

- requests arrive at their trace times; the policy picks a replica from a `RouterView` (requests
  in flight, outstanding tokens, and for `exact` the replicas' real caches) and the request joins
  that replica's waiting queue;
- an idle replica with work starts a step: its scheduler forms the batch, and the step lasts what
  the time model says for that batch's prefill tokens, decodes and context; when it ends, first
  tokens count toward time to first token (TTFT) and finished requests leave.

Most steps of a fleet are plain decode steps: each running request gets one token and nothing else
happens. A `SimReplica` runs a stretch of them (no request waiting, none finishing, room in the
pool: `kvlearn.serving.fast_forward`) in one `advance` call, as many scheduler steps would (the same
slots, evictions, stats);
the loop still times each step and updates the router's view after each, and an arrival at the
replica ends the stretch after the step in progress. The result is the step-by-step one
(`fast_forward=False` checks it), at a fraction of the cost: a scheduler step costs a tenth of a
millisecond of Python, and a fleet runs millions of them.

A pooled fleet (`simulate_fleet(..., pool_tokens=N)`) adds one `PrefixPool` of N tokens below
every replica's own cache (`kvlearn.routing.pooled`): a replica loads from it the prefixes it lacks,
and the step that admits them takes the time model's `load_s_per_token` for each token loaded.

Invariants checked at the end: every request finished, and each replica's prompt tokens equal its
cached plus computed prefill tokens when nothing was preempted.
"""

from __future__ import annotations

import heapq
import statistics
import time
from dataclasses import dataclass, field, replace

from kvlearn.errors import KVCapacityError, check_int, check_positive_int
from kvlearn.routing.policies import Policy, RouterView
from kvlearn.routing.pooled import POOL_LOAD_S_PER_TOKEN, PrefixPool
from kvlearn.routing.replicas import SimReplica, known_prefix_len
from kvlearn.routing.timemodel import TimeModel, default_time_model
from kvlearn.routing.trace_request import TraceRequest
from kvlearn.routing.traces import unique_token_floor
from kvlearn.serving.cache_modes import CACHE_MODES, default_page_size
from kvlearn.serving.request import Request, RequestStatus


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
    loaded_tokens: int = 0    # cached tokens copied in from below the replicas' pools (a shared pool)
    pool_tokens: int = 0      # capacity of the shared pool (0: none)
    per_replica: list[dict] = field(default_factory=list)
    router: dict = field(default_factory=dict)
    routes: dict = field(default_factory=dict)    # trace id -> replica it was sent to
    outputs: dict = field(default_factory=dict)   # trace id -> generated token ids (when kept)

    SUMMARY = ("policy", "replicas", "requests", "prompt_tokens", "computed_prefill_tokens", "unique_token_floor",
               "hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s")

    def summary(self) -> dict:
        """The fields `route --json` prints, plus the simulator's own cost."""
        row = {k: getattr(self, k) for k in self.SUMMARY}
        row.update(cached_tokens=self.cached_tokens, loaded_tokens=self.loaded_tokens, pool_tokens=self.pool_tokens,
                   makespan_s=self.makespan_s, preemptions=self.preemptions,
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


def check_fits(trace: list[TraceRequest], replica) -> None:
    """Refuse a trace whose largest request could never fit in one replica's pool."""
    largest = max(trace, key=lambda r: r.num_prompt_tokens + r.max_new_tokens)
    probe = Request(-1, largest.prompt_ids, largest.max_new_tokens, page_size=replica.page_size)
    if not replica.kv.fits(probe):
        raise KVCapacityError(
            f"{largest.where} needs KV for {probe.max_tokens} tokens ({largest.num_prompt_tokens} prompt + "
            f"{largest.max_new_tokens} new - 1) but a replica's pool holds {replica.kv.capacity}: use more slots "
            f"per replica (--slots-per-replica), or drop that request.")


@dataclass
class Stretch:
    """A replica's stretch of plain decode steps (`SimEngine.decode_stretch`). The loop times its
    steps one by one; the replica runs them (`advance`) when the stretch ends or, where they evict,
    as far as the step in progress as soon as the router asks what the replica caches."""

    decoding: int         # requests decoding, one token each per step
    context: int          # their context tokens in the step in progress (one more each per step)
    planned: int          # steps it may run
    evicts: bool          # whether its steps evict cached tokens
    timed: int = 0        # steps ended, in simulated time
    applied: int = 0      # steps the replica has run
    cut: bool = False     # a request arrived: the stretch ends with the step in progress


class FleetLoop:
    """`run_fleet`'s event loop. Events are arrivals (in trace order) and step ends (a heap of
    (end time, sequence number, replica, requests that got a token, or None for a step of a
    stretch)); each replica runs at most one step at a time, and starts the next when one ends
    while it has work. `view` is what the router sees, up to date after every event."""

    def __init__(self, trace: list[TraceRequest], policy: Policy, replicas: list, time_model: TimeModel,
                 keep_outputs: bool = False, fast_forward: bool = True, bar=None):
        n = len(replicas)
        self.trace, self.policy, self.replicas, self.step_s = trace, policy, replicas, time_model.step_s
        self.keep_outputs, self.bar = keep_outputs, bar
        self.view = RouterView([0] * n, [0] * n, cached_len=self.cached_len)
        self.now = trace[0].arrival
        self.events: list[tuple[float, int, int, list | None]] = []
        self.seq = 0                                  # ties on the heap end in the order steps started
        self.busy = [False] * n                       # a step in progress
        self.busy_s, self.routed = [0.0] * n, [0] * n
        self.stretch: list[Stretch | None] = [None] * n
        self.can_stretch = [fast_forward and hasattr(rep, "decode_stretch") for rep in replicas]
        self.last_computed = [rep.stats["computed_prefill_tokens"] for rep in replicas]
        self.last_loaded = [self.loaded(rep) for rep in replicas]
        self.owner: dict[int, TraceRequest] = {}     # id(Request) -> its trace request, while it runs
        self.ttft: list[float] = []
        self.routes, self.outputs = {}, {}
        self.done = self.output_tokens = 0

    def run(self) -> None:
        """Serve the whole trace: the next event is the earlier of the next arrival and step end."""
        trace, events, arrived = self.trace, self.events, 0
        while arrived < len(trace) or events:
            if arrived < len(trace) and (not events or trace[arrived].arrival < events[0][0]):
                self.arrive(arrived)
                arrived += 1
                continue
            self.now, _, i, progressed = heapq.heappop(events)
            if progressed is None:
                self.end_stretch_step(i)
            else:
                self.end_step(i, progressed)

    def arrive(self, index: int) -> None:
        """The policy routes the trace's request `index`; it joins its replica's waiting queue."""
        treq = self.trace[index]
        self.now = treq.arrival
        i = self.policy.choose(treq, self.view)
        self.policy.routed(treq, i)
        self.routes[treq.id] = i
        self.owner[id(self.replicas[i].submit(index, treq))] = treq
        self.routed[i] += 1
        self.view.inflight[i] += 1
        self.view.outstanding[i] += treq.num_prompt_tokens + treq.max_new_tokens
        if self.stretch[i] is not None:
            self.stretch[i].cut = True   # the request waits for the step in progress to end
        elif not self.busy[i]:
            self.start_step(i)

    def start_step(self, i: int) -> None:
        """Replica i starts its next step: a stretch of decodes where it can, else one scheduler step."""
        rep = self.replicas[i]
        if self.can_stretch[i]:
            planned, evicts = rep.decode_stretch()
            if planned:
                running = rep.scheduler.running
                s = self.stretch[i] = Stretch(len(running), sum(len(req.token_ids) for req in running), planned, evicts)
                self.push_step(i, self.step_s(0, s.decoding, s.context), None)
                return
        progressed = rep.step()
        context = sum(len(req.token_ids) - 1 for req in progressed)
        decodes = sum(len(req.token_ids) - req.num_prompt_tokens > 1 for req in progressed)
        computed = rep.stats["computed_prefill_tokens"] - self.last_computed[i]
        self.last_computed[i] += computed
        loaded = self.loaded(rep) - self.last_loaded[i]
        self.last_loaded[i] += loaded
        self.push_step(i, self.step_s(computed, decodes, context, loaded), progressed)

    @staticmethod
    def loaded(replica) -> int:
        """Tokens the replica has loaded from below its pool so far (chapter 8's tier counters)."""
        counters = replica.kv.counters()
        return counters["loaded_from_host_tokens"] + counters["loaded_from_disk_tokens"]

    def push_step(self, i: int, duration: float, progressed: list | None) -> None:
        """Replica i is busy for `duration` seconds from now."""
        self.busy_s[i] += duration
        self.busy[i] = True
        self.seq += 1
        heapq.heappush(self.events, (self.now + duration, self.seq, i, progressed))

    def end_stretch_step(self, i: int) -> None:
        """A step of replica i's stretch ended: every request decoded one token."""
        s = self.stretch[i]
        s.timed += 1
        self.output_tokens += s.decoding
        self.view.outstanding[i] -= s.decoding
        if s.timed < s.planned and not s.cut:   # its next step, timed as a scheduler step would be
            s.context += s.decoding
            self.push_step(i, self.step_s(0, s.decoding, s.context), None)
            return
        if s.applied < s.timed:
            self.replicas[i].advance(s.timed - s.applied)
        self.stretch[i] = None
        self.busy[i] = False
        if self.replicas[i].has_unfinished():
            self.start_step(i)

    def end_step(self, i: int, progressed: list[Request]) -> None:
        """A scheduler step of replica i ended: first tokens count toward TTFT, finished requests leave."""
        self.busy[i] = False
        self.output_tokens += len(progressed)
        outstanding = self.view.outstanding
        for req in progressed:
            treq = self.owner[id(req)]
            generated = len(req.token_ids) - req.num_prompt_tokens
            outstanding[i] -= 1 + (req.num_prompt_tokens if generated == 1 else 0)
            if generated == 1:
                self.ttft.append(self.now - treq.arrival)
            if req.status == RequestStatus.FINISHED:
                del self.owner[id(req)]
                self.view.inflight[i] -= 1
                outstanding[i] -= treq.max_new_tokens - generated
                self.done += 1
                if self.keep_outputs:
                    self.outputs[treq.id] = req.token_ids[req.num_prompt_tokens:]
                if self.bar is not None and self.done % 256 == 0:
                    self.bar.update(256)
        if self.replicas[i].has_unfinished():
            self.start_step(i)

    def cached_len(self, i: int, prompt: list[int]) -> int:
        """What `exact` asks (`known_prefix_len`). A stretch whose steps evict changes the cache:
        the replica first runs it up to the step in progress (which started before this moment)."""
        s = self.stretch[i]
        if s is not None and s.evicts and s.applied < s.timed + 1:
            self.replicas[i].advance(s.timed + 1 - s.applied)
            s.applied = s.timed + 1
        return known_prefix_len(self.replicas[i], prompt)

    def result(self, wall_s: float) -> FleetResult:
        """The run's measures; checks that every request finished and each replica's prompt
        tokens are its cached plus computed ones where nothing was preempted."""
        assert self.done == len(self.trace) and not self.owner and not any(self.view.inflight), \
            "requests left unfinished"
        per_replica = []
        for i, rep in enumerate(self.replicas):
            s = rep.stats
            per_replica.append({"replica": i, "requests": self.routed[i], "busy_s": round(self.busy_s[i], 4),
                                "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
                                "computed_prefill_tokens": s["computed_prefill_tokens"],
                                "preemptions": s["preemptions"]})
        for r in per_replica:
            assert r["preemptions"] or r["prompt_tokens"] == r["cached_tokens"] + r["computed_prefill_tokens"], \
                f"replica {r['replica']}: prompt tokens are not cached + computed: {r}"
        total = {k: sum(r[k] for r in per_replica)
                 for k in ("prompt_tokens", "cached_tokens", "computed_prefill_tokens", "preemptions")}
        makespan = self.now - self.trace[0].arrival
        prefill = total["cached_tokens"] + total["computed_prefill_tokens"]
        mean_busy = sum(self.busy_s) / len(self.replicas)
        policy = self.policy
        router = policy.tree_stats() if hasattr(policy, "tree_stats") else {}
        if hasattr(policy, "decisions"):
            router = {**router, "decisions": dict(policy.decisions)}
        return FleetResult(
            policy=policy.name, replicas=len(self.replicas), requests=len(self.trace),
            prompt_tokens=total["prompt_tokens"], computed_prefill_tokens=total["computed_prefill_tokens"],
            cached_tokens=total["cached_tokens"], unique_token_floor=unique_token_floor(self.trace),
            hit_rate=round(total["cached_tokens"] / prefill, 4) if prefill else 0.0,
            load_imbalance=round(max(self.busy_s) / mean_busy, 3) if mean_busy else 1.0,
            ttft_p50_s=round(_percentile(self.ttft, 50), 4), ttft_p99_s=round(_percentile(self.ttft, 99), 4),
            throughput_tok_s=round(self.output_tokens / makespan, 1) if makespan else 0.0,
            makespan_s=round(makespan, 3), output_tokens=self.output_tokens, preemptions=total["preemptions"],
            wall_s=wall_s, loaded_tokens=sum(self.last_loaded), per_replica=per_replica, router=router,
            routes=self.routes, outputs=self.outputs)


def run_fleet(trace: list[TraceRequest], policy: Policy, replicas: list, time_model: TimeModel | None = None,
              keep_outputs: bool = False, progress: bool = False, fast_forward: bool = True) -> FleetResult:
    """Serve `trace` (sorted by arrival) on `replicas` (SimReplica or EngineReplica) routed by `policy`.

    fast_forward: let a SimReplica run a stretch of plain decode steps (`SimEngine.decode_stretch`) as one
    `advance` call. The loop still times every step and updates the router's view after each, and
    an arrival at the replica ends the stretch after the step in progress, so the result is the
    same as stepping one by one (False does that, for checking)."""
    if not trace:
        raise ValueError("The trace is empty: give at least one request.")
    if not replicas:
        raise ValueError("A fleet needs at least one replica.")
    check_fits(trace, replicas[0])
    bar = None
    if progress:
        from kvlearn.progress import progress_bar
        bar = progress_bar(total=len(trace), desc=f"route {policy.name}", unit="req", leave=False, mininterval=0.5)
    loop = FleetLoop(trace, policy, replicas, time_model or default_time_model(), keep_outputs, fast_forward, bar)
    start = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return loop.result(wall)


def simulate_fleet(trace: list[TraceRequest], policy, num_replicas: int, cache: str = "radix",
                   slots_per_replica: int = 16384, page_size: int | None = None, time_model: TimeModel | None = None,
                   max_batch_tokens: int = 2048, schedule: str = "fcfs", max_requests: int = 64,
                   progress: bool = False, fast_forward: bool = True, pool_tokens: int = 0,
                   **policy_options) -> FleetResult:
    """Simulate `trace` on `num_replicas` model-free replicas; `policy` is a name or a Policy.
    page_size: tokens per page of each replica's pool (default: the cache mode's). max_requests:
    requests a replica runs at once (each holds a row of max context length: memory grows with it).
    fast_forward: see `run_fleet` (the same result either way, only faster). pool_tokens > 0: a
    pooled fleet, one shared `PrefixPool` of that many tokens below every replica's radix cache
    (`kvlearn.routing.pooled`); a time model without a load cost of its own then charges
    POOL_LOAD_S_PER_TOKEN per token loaded. The run uses one torch thread (its tensors are a few
    thousand slots, where a second thread only waits), and restores the setting after."""
    import torch

    from kvlearn.routing.policies import make_policy

    check_positive_int("num_replicas", num_replicas, " (replicas in the fleet)")
    check_positive_int("slots_per_replica", slots_per_replica, " (KV slots per replica)")
    check_int("pool_tokens", pool_tokens, what=" (tokens of the shared pool; 0: none)")
    if cache not in CACHE_MODES:
        raise ValueError(f"Unknown cache {cache!r}: choose one of {', '.join(CACHE_MODES)}.")
    if policy == "cache_aware":   # by default the router's guess of a replica is as big as its pool
        policy_options.setdefault("max_tree_pages", slots_per_replica // policy_options.get("tree_page_size", 16) or 1)
    if isinstance(policy, str):
        policy = make_policy(policy, num_replicas, **policy_options)
    time_model = time_model or default_time_model()
    shared = None
    if pool_tokens:
        shared = PrefixPool(pool_tokens, default_page_size(cache) if page_size is None else page_size)
        if not time_model.load_s_per_token:
            time_model = replace(time_model, load_s_per_token=POOL_LOAD_S_PER_TOKEN)
    replicas = [SimReplica(cache, slots_per_replica, page_size, max_batch_tokens, schedule, max_requests, shared)
                for _ in range(num_replicas)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_fleet(trace, policy, replicas, time_model, progress=progress, fast_forward=fast_forward)
    finally:
        torch.set_num_threads(threads)
    result.pool_tokens = pool_tokens
    return result
