"""The scheduler without the model (chapter 6): what each cache mode would compute on a workload.

The scheduler's decisions depend on token ids and pool size, not on the numbers in K and V, so a
run with a one-number-per-slot pool and no model gives the prefill counts, hit rate and peak slots
of a real run, except where real outputs would have been shared: here every request generates the
answer it was given (none, by default), then the same filler token, and none stops early.

`SimEngine` is that driver, the one every model-free run uses (`simulate` here, chapter 8's
`simulate_tiers`, chapter 7's `SimReplica`): `step()` is one scheduler step, as `Engine.step`
without the forward; `advance(steps)` runs a stretch of plain decode steps in one call
(`kvlearn.serving.fast_forward`), with the outcome of as many `step()` calls.
"""

from __future__ import annotations

from kvlearn.errors import KVCapacityError, check_positive_int
from kvlearn.pool import KVPool
from kvlearn.serving import fast_forward
from kvlearn.serving.cache_modes import default_page_size, make_kv_manager
from kvlearn.serving.engine import slots_without_sharing, stats_with_hit_rate
from kvlearn.serving.kv_manager import KVManager
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler


class SimEngine:
    """A real `Scheduler` over a KV manager, without the model. Each request "generates" the answer
    it was added with, then `filler` (any token id the scheduler does not stop at); `options` are the
    scheduler's. `scheduler_cls`: the scheduler's class (a learner's part, kvlearn.parts "scheduler"),
    built like `Scheduler(kv, **options)`."""

    def __init__(self, kv: KVManager, filler: int, scheduler_cls=Scheduler, **options):
        self.kv, self.filler = kv, filler
        self.scheduler = scheduler_cls(kv, **options)
        self.answers: dict[int, tuple[int, ...]] = {}   # rid -> the answer it generates, while it runs

    def add(self, req: Request, answer: tuple[int, ...] = ()) -> Request:
        if not self.kv.fits(req):
            raise KVCapacityError(f"Prompt {req.rid} needs KV for {req.max_tokens} tokens but the pool holds "
                                  f"{self.kv.capacity}: use a bigger num_slots.")
        if answer:
            self.answers[req.rid] = tuple(answer)
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def stats(self) -> dict:
        return self.scheduler.stats

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that got a token (a chunk of a prompt that is
        not its last one gets none yet)."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("The scheduler found nothing to run although requests wait: a kvlearn bug.")
        tokens, before = [], []
        for req in batch.requests:
            answer, k = self.answers.get(req.rid, ()), len(req.token_ids) - req.num_prompt_tokens
            tokens.append(answer[k] if k < len(answer) else self.filler)
            before.append(len(req.token_ids))
        for req in self.scheduler.postprocess(batch, tokens):
            self.answers.pop(req.rid, None)
        return [req for req, n in zip(batch.requests, before, strict=True) if len(req.token_ids) > n]

    def decode_stretch(self) -> tuple[int, bool]:
        """How many of the next steps `advance` can run at once, and whether they evict
        (`fast_forward.decode_stretch`: (0, False) for a scheduler not built on `SchedulerBase`)."""
        return fast_forward.decode_stretch(self.scheduler)

    def advance(self, steps: int) -> None:
        """Run the next `steps` plain decode steps at once (at most `decode_stretch()`'s), with the
        outcome of as many `step()` calls: the same tokens, slots, evictions, stats and last report."""
        tokens = []
        for req in self.scheduler.running:
            k = len(req.token_ids) - req.num_prompt_tokens
            answer = self.answers.get(req.rid, ())[k:k + steps]
            tokens.append(answer + (self.filler,) * (steps - len(answer)))
        fast_forward.run_decode_stretch(self.scheduler, steps, tokens)

    def run(self) -> dict:
        """Serve every request added so far to the end; returns the scheduler's stats."""
        while self.scheduler.has_unfinished():
            steps, _ = self.decode_stretch()
            if steps:
                self.advance(steps)
            else:
                self.step()
        return self.stats


def simulate(workload, cache: str, max_new_tokens: int = 32, num_slots: int | None = None,
             page_size: int | None = None, schedule: str = "fcfs") -> dict:
    """Run the scheduler on a workload's prompts (a Workload or a list of token-id lists) without
    the model, and return its stats (those of `Engine.stats`, wall time 0)."""
    check_positive_int("max_new_tokens", max_new_tokens)
    prompts = workload.prompt_lists() if hasattr(workload, "prompt_lists") else [list(p) for p in workload]
    if not prompts or not all(prompts):
        raise ValueError("simulate needs at least one prompt, and no empty prompt.")
    page_size = default_page_size(cache) if page_size is None else page_size
    num_slots = num_slots or slots_without_sharing(prompts, max_new_tokens, page_size)
    kv = make_kv_manager(cache, KVPool(1, 1, 1, num_slots, page_size=page_size))  # slots only: one number each
    sim = SimEngine(kv, filler=prompts[0][-1], schedule=schedule)  # any token id; never an end of sequence
    for rid, prompt in enumerate(prompts):
        sim.add(Request(rid, prompt, max_new_tokens, page_size))
    return stats_with_hit_rate(sim.run(), 0.0)
