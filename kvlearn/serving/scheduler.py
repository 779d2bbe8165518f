"""The scheduler: which requests run in the next step, and where their KV lives.

Every step forms one batch under a token budget (`max_batch_tokens`):

1. every running request decodes one token; a request that needs a new slot and cannot get one,
   even after evicting unlocked cached tokens, makes the scheduler preempt the most recently
   admitted request (vLLM's recompute preemption: its slots go back and it re-queues);
2. a request still prefilling a long prompt computes its next chunk (chunked prefill, below);
3. waiting requests are admitted, in `fcfs` order or `lpm` order (longest cached prefix first,
   SGLang's policy), while the budget and the pool allow; each computes only its uncached suffix.

Chunked prefill (on by default, as in vLLM and SGLang): a prompt whose uncached part is larger than
what is left of the budget computes only that much now and the rest in later steps, while the
running requests keep decoding; without it, such a prompt waits until nothing else runs, then runs
whole. A chunk is an ordinary prefill over the prompt's own earlier chunks; the prompt joins the
cache after its last chunk (vLLM and SGLang cache each chunk; kvlearn keeps the simpler rule).

A request that shares a not-yet-computed prefix with one admitted in the same step waits a step, so
the prefix is computed once (SGLang's in-batch prefix check). vLLM runs it in the same step, reading
the partner's K and V written earlier in the same forward; kvlearn keeps the wait (2-5 % on the
bench), and its cache only ever holds KV that has been computed.

Where each request's KV lives is the business of a KV manager (the contract in
`kvlearn.serving.kv_manager`): the scheduler only asks it to admit, grow and release requests, and
has it check slot conservation after every step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvlearn.errors import check_choice, check_int, check_positive_int
from kvlearn.serving.kv_manager import KVManager
from kvlearn.serving.prefixes import common_prefix_len
from kvlearn.serving.request import Request, RequestStatus

SCHEDULES = ("fcfs", "lpm")
# lpm sorts the queue by a prefix match per request; past this length it costs more than it
# saves, and the scheduler falls back to fcfs (SGLang does the same).
LPM_MAX_QUEUE = 128


@dataclass
class Batch:
    """One step's work: for each request, the tokens to compute and its whole context's slots."""

    requests: list[Request] = field(default_factory=list)
    input_ids: list[list[int]] = field(default_factory=list)
    kv_indices: list[torch.Tensor] = field(default_factory=list)
    num_prefills: int = 0  # the first num_prefills requests prefill (whole prompts or chunks), the rest decode

    def add(self, req: Request, kv_indices: torch.Tensor, num_tokens: int) -> None:
        """Compute `num_tokens` of `req`, from its first token without KV; `kv_indices` are the
        slots of its whole context (they reach at least that far)."""
        end = req.num_computed + num_tokens
        self.requests.append(req)
        self.input_ids.append(req.token_ids[req.num_computed:end])
        self.kv_indices.append(kv_indices[:end])

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepReport:
    """What one step did, for logs and notebooks. Prefills are (rid, cached, computed) tokens."""

    step: int
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (rid, start, computed) of a started prompt
    decodes: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    stopped: str = ""         # why admission stopped: "budget", "wait" (too big to chunk), "full" (the pool)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    evicted_tokens: int = 0
    used_slots: int = 0       # by live requests, shared slots once (after this step's admissions)
    evictable_slots: int = 0  # held only by the cache
    free_slots: int = 0

    def __repr__(self) -> str:
        parts = [f"step {self.step}:"]
        if self.prefills:
            parts.append("prefill " + ", ".join(f"r{r} ({c} cached + {n} computed)" for r, c, n in self.prefills))
        if self.chunks:
            parts.append("chunk " + ", ".join(f"r{r} (tokens {s}-{s + n - 1})" for r, s, n in self.chunks))
        for label, rids in (("decode", self.decodes), ("deferred", self.deferred), ("preempted", self.preempted),
                            ("finished", self.finished)):
            if rids:
                parts.append(f"{label} " + " ".join(f"r{r}" for r in rids))
        if self.evicted_tokens:
            parts.append(f"evicted {self.evicted_tokens} tokens")
        parts.append(f"| slots: {self.used_slots} in use, {self.evictable_slots} cached, {self.free_slots} free")
        return " ".join(parts)


STAT_NAMES = ("requests", "prompt_tokens", "computed_prefill_tokens", "cached_tokens", "output_tokens",
              "evicted_tokens", "preemptions", "peak_slots", "steps")


class SchedulerBase:
    """The scheduler's bookkeeping that chapter 6 does not teach: the queues, the step's report and
    the stats, building the batch, and everything after the forward. A scheduler is this base plus
    `schedule()`, the step's decisions (the package's `Scheduler`, or a learner's `MyScheduler`,
    kvlearn.parts "scheduler"), which call the mechanics here: `begin_step` first, then `preempt`,
    `queue_order`, `shares_in_batch` and `start` as they decide, and `form_batch` last.

    `waiting` is the queue (a preempted request goes first); `running` holds the requests with KV
    in admission order, so the newest is last. The scheduler owns each request's `status` and
    `num_computed`; the KV manager owns `req.kv`.

    in_batch_threshold: the margin of `shares_in_batch` (0 turns that check off). chunked_prefill:
    as in the module docstring (False: a prompt too big for the budget left waits, then runs alone,
    whole, when nothing else is running). `stats` counts since the last `reset_stats()`: prefill
    counts include recomputation after a preemption; peak_slots is the most slots live requests used
    at once, shared slots once.
    """

    def __init__(self, kv: KVManager, max_batch_tokens: int = 2048, schedule: str = "fcfs",
                 eos_token_ids=(), in_batch_threshold: int = 1, chunked_prefill: bool = True):
        check_choice("schedule", schedule, SCHEDULES)
        check_positive_int("max_batch_tokens", max_batch_tokens)
        check_int("in_batch_threshold", in_batch_threshold)
        self.kv, self.max_batch_tokens, self.schedule_policy = kv, max_batch_tokens, schedule
        self.eos_token_ids = frozenset(eos_token_ids)
        self.in_batch_threshold, self.chunked_prefill = in_batch_threshold, bool(chunked_prefill)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preemption takes from the end
        self.num_steps = 0
        self.report = StepReport(0)
        self._evicted_before = 0
        self._started: list[list[int]] = []  # the prompts admitted in this step (SGLang's in-batch prefix check)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STAT_NAMES, 0)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += req.num_prompt_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Pick this step's batch (the step's decisions: a subclass writes them)."""
        raise NotImplementedError("schedule() makes the step's decisions: write it in your scheduler")

    # --- the mechanics the decisions call ------------------------------------------------------
    def begin_step(self) -> None:
        """Mutation: a new step, with an empty report (call it first in `schedule`)."""
        self.num_steps += 1
        self.report = StepReport(self.num_steps)
        self._evicted_before = self.kv.evicted_tokens
        self._started = []

    def preempt(self, req: Request) -> None:
        """Mutation: recompute preemption. The running request gives its slots back (its computed
        tokens go to the cache, if any) and goes first in line to be prefilled again, outputs
        included; the report lists it."""
        self._release_and_remove(req, RequestStatus.WAITING)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.report.preempted.append(req.rid)

    def queue_order(self):
        """Query: (request, cached prefix length) for the waiting requests, in the order to try
        admitting them: the queue's (fcfs), or longest cached prefix first (lpm, ties first come
        first served; past LPM_MAX_QUEUE waiting requests, fcfs). Changes no cache."""
        if self.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            pairs = [(req, self.kv.cached_len(req.token_ids)) for req in self.waiting]
            pairs.sort(key=lambda pair: -pair[1])  # stable: ties stay first come, first served
            return pairs
        # fcfs matches lazily: admission usually stops long before the end of the queue.
        return ((req, self.kv.cached_len(req.token_ids)) for req in list(self.waiting))

    def shares_in_batch(self, req: Request, cached: int) -> bool:
        """Query: whether the request shares at least `in_batch_threshold` more tokens (whole pages,
        its last token left out) with a prompt started in this step than with the cache (`cached`):
        admitted now, it would compute that part a second time; after this step it finds it in the
        cache. Always False without a prefix cache or with in_batch_threshold 0."""
        if not (self.kv.caches_prefixes and self.in_batch_threshold):
            return False
        shared = max((common_prefix_len(req.token_ids[:-1], prompt) for prompt in self._started), default=0)
        return shared // self.kv.page_size * self.kv.page_size - cached >= self.in_batch_threshold

    def start(self, req: Request, budget: int) -> int | None:
        """Mutation: admit a waiting request: its KV (the KV manager reuses what is cached), status
        running, last in `running`, in the report. Returns the tokens it computes in this step (its
        uncached part, cut to `budget` with chunked prefill), or None, with nothing changed, when
        the pool or the rows are short."""
        cached = self.kv.admit(req)  # what admission actually found
        if cached is None:
            return None
        self.waiting.remove(req)
        req.status, req.num_computed, req.prefill_len = RequestStatus.RUNNING, cached, len(req.token_ids)
        self.running.append(req)
        extend = len(req.token_ids) - cached
        now = min(extend, budget) if self.chunked_prefill else extend
        self.report.prefills.append((req.rid, cached, now))
        self._started.append(req.token_ids)
        return now

    def form_batch(self, prefills: list[tuple[Request, int]], chunks: list[tuple[Request, int]],
                   decodes: list[Request]) -> Batch:
        """Mutation: the step's batch (admissions, then chunks of prompts already started, then
        decodes), with the report and stats completed (call it last in `schedule`)."""
        batch = Batch(num_prefills=len(prefills) + len(chunks))
        for req, n in prefills + chunks + [(req, 1) for req in decodes]:
            batch.add(req, self.kv.kv_indices(req), n)
        report, kv = self.report, self.kv
        report.chunks = [(req.rid, req.num_computed, n) for req, n in chunks]
        report.decodes = [r.rid for r in decodes]
        report.evicted_tokens = kv.evicted_tokens - self._evicted_before
        report.used_slots, report.evictable_slots = kv.slots_in_use(self.running), kv.evictable_slots
        report.free_slots = kv.free_slots
        stats = self.stats
        stats["steps"] += 1
        stats["cached_tokens"] += sum(cached for _, cached, _ in report.prefills)
        stats["computed_prefill_tokens"] += sum(n for _, _, n in report.prefills + report.chunks)
        stats["evicted_tokens"] += report.evicted_tokens
        stats["preemptions"] += len(report.preempted)
        stats["peak_slots"] = max(stats["peak_slots"], report.used_slots)
        return batch

    def abort(self, requests: list[Request]) -> None:
        """Take these requests out (after a failed or interrupted step): running ones give back
        their KV as a preemption would, waiting ones leave the queue; all end "aborted". A failing
        release stops nothing: that request is released again at once without caching anything
        (`num_computed` 0: its KV only goes back, a release can be repeated), the others follow,
        and only then is the error raised: the one error, or a BaseExceptionGroup of all of them
        in the order they happened (an ExceptionGroup when none is a KeyboardInterrupt or the like)."""
        errors = []
        for req in requests:
            if req.status == RequestStatus.WAITING and req in self.waiting:
                self.waiting.remove(req)
                req.status = RequestStatus.ABORTED
            elif req.status == RequestStatus.RUNNING:
                try:
                    self._release_and_remove(req, RequestStatus.ABORTED)
                except BaseException as err:
                    errors.append(err)
                    req.num_computed = 0
                    try:
                        self._release_and_remove(req, RequestStatus.ABORTED)
                    except BaseException as again:
                        errors.append(again)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise BaseExceptionGroup(f"aborting {len(requests)} requests: {len(errors)} releases failed", errors)

    def _release_and_remove(self, req: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """A running request gives its KV back and leaves `running`."""
        self.kv.release(req)
        self.running.remove(req)
        req.status = status

    # --- after the forward ----------------------------------------------------------------------
    def postprocess(self, batch: Batch, next_tokens: list[int]) -> list[Request]:
        """Record each request's sampled token; release and return the requests that finished.
        A request leaves `running` as soon as its KV is released."""
        finished = []
        for i, (req, ids, token) in enumerate(zip(batch.requests, batch.input_ids, next_tokens, strict=True)):
            if req.num_computed + len(ids) < req.prefill_len:  # a chunk, not the prompt's end:
                req.num_computed += len(ids)                  # no token, nothing published yet
                continue
            self.kv.after_forward(req, prefilled=i < batch.num_prefills)
            req.num_computed = len(req.token_ids)
            req.token_ids.append(token)
            self.stats["output_tokens"] += 1
            if token in self.eos_token_ids or req.done:
                self._release_and_remove(req)
                finished.append(req)
        self.report.finished = [r.rid for r in finished]
        self.kv.check(self.running)
        return finished


class Scheduler(SchedulerBase):
    """Continuous batching over a KV manager: `schedule()` a batch, run it, `postprocess()` it.
    The step's decisions (the module docstring's three rules); the rest is `SchedulerBase`."""

    def schedule(self) -> Batch:
        """The module docstring's three rules, in order; no admissions in a step that preempted."""
        self.begin_step()
        decodes = self._decodes()
        budget = self.max_batch_tokens - len(decodes)
        chunks = []
        for req in self.running:  # the next chunk of each prompt already started, oldest first
            if req.prefilling and budget > 0:
                chunks.append((req, min(len(req.token_ids) - req.num_computed, budget)))
                budget -= chunks[-1][1]
        prefills = [] if self.report.preempted else self._admit(budget)
        return self.form_batch(prefills, chunks, decodes)

    def _decodes(self) -> list[Request]:
        """The running requests that decode this step, each given a slot for its newest token,
        preempting from the back when the pool has none (a request still in the middle of a
        chunked prompt took its slots at admission)."""
        decodes = []
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop: so is the rest
                break
            if req.prefilling:
                continue
            while not self.kv.grow(req):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            else:
                decodes.append(req)
        return decodes

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests while budget and pool allow: (request, tokens to compute now)."""
        admitted = []
        for req, cached in self.queue_order():
            too_big = len(req.token_ids) - cached > budget
            if budget <= 0 or (too_big and not self.chunked_prefill and (admitted or self.running)):
                self.report.stopped = "budget" if budget <= 0 else "wait"
                break
            if self.shares_in_batch(req, cached):
                self.report.deferred.append(req.rid)  # its partner's prompt reaches the cache after this step
                continue
            now = self.start(req, budget)
            if now is None:  # the pool is full; running requests free slots as they finish
                self.report.stopped = "full"
                break
            admitted.append((req, now))
            budget -= now
        return admitted

