"""Many plain decode steps at once: the model-free drivers' shortcut, no part of what chapter 6 teaches.

Most steps of a long simulated run are plain decode steps: no request waits, every running one
decodes one token and none finishes. `SimEngine` (kvlearn.serving.simulate), and through it
chapter 7's fleet and chapter 8's tier simulator, runs a stretch of them in one call; the `Engine`
never does. Invariant: `run_decode_stretch(scheduler, n, tokens)` leaves what n rounds of
`schedule()` and `postprocess()` with those tokens leave: the same tokens, slots, evictions,
`num_steps`, `stats` and last `report`.

It works through the public members of the scheduler and the KV manager, and only where it knows
what a decode step does:
- the scheduler is a `SchedulerBase`: the package's `Scheduler`, or a learner's part built on the
  base (one that passes `kvlearn.parts.check` decodes by chapter 6's rules);
- the KV manager is a `PoolPagesKV` ("none", "radix" and their chapter 7-8 kin), whose decode step
  only grows: "blocks" publishes each block a decode fills.
Anywhere else `decode_stretch` is (0, False) and the driver runs one scheduler step at a time.
"""

from __future__ import annotations

import torch

from kvlearn.serving.kv_manager import PoolPagesKV
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import SchedulerBase, StepReport


def decode_stretch(scheduler) -> tuple[int, bool]:
    """Query: how many of the scheduler's next steps are plain decode steps, which only a new request
    could change (no request waits, every running one decodes and none finishes: no end-of-sequence
    token to watch for, none reaching max_new_tokens, and the pool has room for them all without a
    preemption), and whether those steps evict cached tokens. (0, False): the next step must go
    through `schedule()`."""
    if not isinstance(scheduler, SchedulerBase) or not isinstance(scheduler.kv, PoolPagesKV):
        return 0, False
    running = scheduler.running
    if scheduler.waiting or not running or scheduler.eos_token_ids:
        return 0, False
    if any(req.prefilling or req.num_computed != len(req.token_ids) - 1 for req in running):
        return 0, False    # a prompt still in chunks (even with one token left) is not decoding
    # the step that brings a request to max_new_tokens finishes it: stop one before the first
    steps = min(req.max_new_tokens - (len(req.token_ids) - req.num_prompt_tokens) for req in running) - 1
    return _decode_rounds(scheduler.kv, running, steps) if steps > 0 else (0, False)


def run_decode_stretch(scheduler, steps: int, next_tokens: list) -> None:
    """Mutation: run the scheduler's next `steps` plain decode steps at once (at most what
    `decode_stretch` allows), running request j sampling `next_tokens[j]` (`steps` token ids)."""
    running, kv = scheduler.running, scheduler.kv
    if not isinstance(scheduler, SchedulerBase) or not isinstance(kv, PoolPagesKV):
        raise ValueError(f"{type(scheduler).__name__} over {type(kv).__name__} runs one step at a time: "
                         "decode_stretch is (0, False) there, call the scheduler's schedule() instead.")
    if steps < 1 or len(next_tokens) != len(running) or any(len(tokens) != steps for tokens in next_tokens):
        raise ValueError(f"A stretch of {steps} steps needs at least one step, and {steps} tokens for each "
                         f"of the {len(running)} running requests.")
    evicted = _grow_rounds(kv, running, steps)
    for req, tokens in zip(running, next_tokens, strict=True):
        req.token_ids.extend(tokens)
        req.num_computed = len(req.token_ids) - 1
    scheduler.num_steps += steps
    stats = scheduler.stats
    stats["steps"] += steps
    stats["output_tokens"] += steps * len(running)
    stats["evicted_tokens"] += sum(evicted)
    used = kv.slots_in_use(running)   # decode steps only add slots: the last step's count is the peak
    stats["peak_slots"] = max(stats["peak_slots"], used)
    scheduler.report = StepReport(scheduler.num_steps, decodes=[req.rid for req in running],
                                  evicted_tokens=evicted[-1], used_slots=used,
                                  evictable_slots=kv.evictable_slots, free_slots=kv.free_slots)
    kv.check(running)


# --- the KV manager's side: rounds of `grow` (round k gives each request, in turn, a slot for its
# k-th next token), done in a few pool calls

def _round_pages(kv: PoolPagesKV, reqs: list[Request], rounds: int) -> int:
    """Pages the first `rounds` rounds of `grow` over `reqs` take."""
    p = kv.page_size
    return sum(max(0, -(-(len(r.token_ids) + rounds - 1) // p) - r.kv.num_slots // p) for r in reqs)


def _decode_rounds(kv: PoolPagesKV, reqs: list[Request], rounds: int) -> tuple[int, bool]:
    """How many of the next `rounds` rounds `_grow_rounds` can run, none of them short of memory
    (free slots and evictable cached slots cover them), and whether they evict cached tokens."""
    room = (kv.pool.num_free + kv.evictable_slots) // kv.page_size
    if _round_pages(kv, reqs, rounds) > room:
        lo, hi = 0, rounds - 1      # the first lo rounds fit, the first hi + 1 do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _round_pages(kv, reqs, mid) <= room else (lo, mid - 1)
        rounds = lo
    return rounds, _round_pages(kv, reqs, rounds) * kv.page_size > kv.free_slots


def _grow_rounds(kv: PoolPagesKV, reqs: list[Request], rounds: int) -> list[int]:
    """What `rounds` rounds of `kv.grow` over `reqs` do, `rounds` at most what `_decode_rounds`
    allows: the same slots in the same order, and the same evictions. Returns the tokens each round
    evicted."""
    pool, rows, p = kv.pool, kv.rows, kv.page_size
    evicted = [0] * rounds
    if p == 1 and all(len(req.token_ids) == req.kv.num_slots + 1 for req in reqs) \
            and pool.num_free >= rounds * len(reqs):
        # the usual case: each request takes one free slot per round, from the first round on
        slots = pool.alloc(rounds * len(reqs)).view(rounds, len(reqs))
        for j, req in enumerate(reqs):
            h = req.kv
            try:
                rows.write(h.row, h.num_slots, slots[:, j])
            except BaseException:   # give back the slots no row recorded
                pool.free(slots[:, j:].reshape(-1))
                raise
            h.num_slots += rounds
        return evicted
    # A request takes a page in the first round whose token finds no slot, then every p rounds;
    # sorting by (round, request) gives the order in which `grow` would take them.
    takes = sorted((k, j) for j, req in enumerate(reqs)
                   for k in range(max(0, req.kv.num_slots - len(req.token_ids) + 1), rounds, p))
    if not takes:
        return evicted
    # Take the pages in runs; where `grow` would find no free page, evict as it would, then go on.
    runs, start, free = [], 0, pool.num_free // p
    try:
        for t, (k, _) in enumerate(takes):
            if not free:
                if t > start:
                    runs.append(pool.alloc((t - start) * p))
                    start = t
                before = kv.evicted_tokens
                kv.evict(p)
                evicted[k] += kv.evicted_tokens - before
                free = pool.num_free // p
            free -= 1
        runs.append(pool.alloc((len(takes) - start) * p))
    except BaseException:
        if runs:
            pool.free(torch.cat(runs))
        raise
    pages = (torch.cat(runs) if len(runs) > 1 else runs[0]).view(-1, p)
    mine: dict[int, list[int]] = {}
    for page, (_, j) in enumerate(takes):
        mine.setdefault(j, []).append(page)
    written: list[int] = []
    try:
        for j, taken in mine.items():
            h = reqs[j].kv
            rows.write(h.row, h.num_slots, pages[taken].reshape(-1))
            h.num_slots += len(taken) * p
            written += taken
    except BaseException:       # give back the pages no row recorded
        pool.free(pages[sorted(set(range(len(takes))) - set(written))].reshape(-1))
        raise
    return evicted
