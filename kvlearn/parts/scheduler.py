"""The `scheduler` part (chapter 6): the step's decisions, admit, evict and preempt.

The engine (and the model-free `SimEngine`, which fast-forwards plain decode steps of a part built on
`SchedulerBase`) builds it like `kvlearn.serving.scheduler.Scheduler` and calls only the members of
`SchedulerPart`. A learner writes `schedule()`; `SchedulerBase` (re-exported here) holds the rest:
the queues, the report and the stats, the mechanics of a preemption and of an admission, and
everything after the forward.
"""

from __future__ import annotations

from typing import Protocol

from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Batch, SchedulerBase, StepReport

__all__ = ["SchedulerPart", "SchedulerBase"]


class SchedulerPart(Protocol):
    """What the engine asks of a scheduler (`kvlearn.serving.engine.Engine.step`).

    The chapter's rules for each `schedule()`, in the order the referee (`Scheduler.schedule`)
    applies them. A request's fields: `req.num_computed` leading tokens have KV, `req.prefill_len`
    is where its prefill ends, and it is still prefilling (`req.prefilling`) while
    num_computed < prefill_len.

    1. Decodes: every running request that is not prefilling decodes one token, oldest first
       (`running` is in admission order). When the KV manager cannot give it a slot (`kv.grow(req)`
       is False, eviction included), the newest running request (`running[-1]`) is preempted and
       the request tries again; if it was the newest itself, it is preempted and does not decode.
    2. Chunks: then each request still prefilling computes its next chunk, oldest first:
       min(prefill_len - num_computed, budget) while budget > 0, where the budget is
       `max_batch_tokens` minus one token per decode.
    3. Admissions, none in a step that preempted: for each waiting request in `queue_order()`
       (request, cached tokens), with `uncached = len(req.token_ids) - cached`:
       a. stop if the budget is spent (budget <= 0);
       b. stop, without chunked prefill, if uncached > budget while something runs or was admitted
          in this step (it runs alone, whole, once nothing else does);
       c. only then: if `shares_in_batch(req, cached)`, defer it (its rid to `report.deferred`; it
          stays in the queue) and try the next; a request stopped by a. or b. must wait anyway and
          is not deferred;
       d. `start(req, budget)`: None means the pool is full, which stops admission; else it returns
          the tokens computed now, which leave the budget.
    The batch lists admissions, chunks, then decodes (`form_batch`).
    """

    kv: object                  # the KV manager (kvlearn.serving.kv_manager.KVManager)
    waiting: object             # a deque of Requests, first in line first
    running: list[Request]      # in admission order: the newest last
    report: StepReport          # what the last step did
    stats: dict                 # counters since reset_stats (kvlearn.serving.scheduler.STAT_NAMES)
    num_steps: int
    max_batch_tokens: int
    schedule_policy: str

    def add(self, req: Request) -> None:
        """Mutation: queue a request."""

    def has_unfinished(self) -> bool:
        """Query: whether a request waits or runs."""

    def schedule(self) -> Batch:
        """Mutation: the step's decisions; returns its batch (`form_batch`)."""

    def postprocess(self, batch: Batch, next_tokens: list[int]) -> list[Request]:
        """Mutation: record the sampled tokens; release and return the finished requests."""

    def abort(self, requests: list[Request]) -> None:
        """Mutation: take these requests out after a failed step."""

    def reset_stats(self) -> None:
        """Mutation: zero the counters."""
