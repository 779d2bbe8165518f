"""The `scheduler` part (chapter 6): the step's decisions, admit, evict and preempt.

The engine (and `SimEngine`) builds it as `cls(kv, max_batch_tokens, schedule, eos_token_ids,
chunked_prefill=...)`, like `kvlearn.serving.scheduler.Scheduler`, and calls only the members of
`SchedulerPart`. A learner writes `schedule()`: which running requests decode (preempting the
newest when the KV manager has no slot; eviction happens inside the KV manager), which prompts
already started compute their next chunk, and which waiting requests are admitted, in queue order,
within the token budget, deferring one that shares an uncomputed prefix with this step's prompts.
`kvlearn.serving.scheduler.SchedulerBase` (re-exported here) holds the rest: the queues, the report
and the stats, the mechanics of a preemption and of an admission, and everything after the forward.
"""

from __future__ import annotations

from typing import Protocol

from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Batch, SchedulerBase, StepReport

__all__ = ["SchedulerPart", "SchedulerBase"]


class SchedulerPart(Protocol):
    """What the engine asks of a scheduler (`kvlearn.serving.engine.Engine.step`).

    Rules (the chapter's), for each `schedule()`: every running request that is not in the middle of
    a chunked prompt decodes one token, oldest first; when the KV manager cannot give one a slot
    (`kv.grow` is False, eviction included), the newest running request is preempted and the
    request tries again (if it was the newest itself, it is preempted and does not decode). Then
    each prompt already started computes its next chunk, oldest first, within the budget
    (`max_batch_tokens` minus one token per decode). Then, unless the step preempted, waiting
    requests are admitted in `queue_order()` while budget is left: one that `shares_in_batch` is
    deferred (it stays in the queue, the next one is tried); the first that the pool cannot hold
    stops admission; without chunked prefill, a prompt bigger than the budget left waits unless
    nothing runs and nothing was admitted. The batch lists admissions, chunks, then decodes.
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

    def decode_stretch(self) -> tuple[int, bool]:
        """Query: how many next steps are plain decode steps (model-free simulators run them at once)."""

    def run_decode_stretch(self, steps: int, next_tokens: list) -> None:
        """Mutation: run that many plain decode steps at once."""
