"""The scheduler without the model (chapter 6): what each cache mode would compute on a workload.

The scheduler's decisions depend on token ids and pool size, not on the numbers in K and V, so a
run with a one-number-per-slot pool and no model gives the prefill counts, hit rate and peak slots
of a real run, except where real outputs would have been shared: here every request generates the
same filler token, and none stops early.
"""

from __future__ import annotations

from kvlearn.errors import KVCapacityError, check_positive_int
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import default_page_size, make_kv_manager
from kvlearn.serving.engine import slots_without_sharing, with_rates
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import Scheduler


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
    scheduler = Scheduler(kv, schedule=schedule)
    for rid, prompt in enumerate(prompts):
        req = Request(rid, prompt, max_new_tokens, page_size)
        if not kv.fits(req):
            raise KVCapacityError(f"Prompt {rid} needs KV for {req.max_tokens} tokens but the pool holds "
                                  f"{kv.capacity}: use a bigger num_slots.")
        scheduler.add(req)
    filler = prompts[0][-1]  # any token id; never an end of sequence
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [filler] * len(batch))
    return with_rates(scheduler.stats, 0.0)
