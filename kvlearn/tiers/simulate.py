"""Chapter 8: the scheduler without the model (chapter 6's `SimEngine`), over the tiered mode.

Each round of prompts is one batch of arrivals, served to the end before the next round comes (as
users take turns in a chat). Every request answers with the same filler token; the pools hold one
number per slot. Prefill counts and tier traffic are those of a real run with that output.
"""

from __future__ import annotations

from kvlearn.pool import KVPool
from kvlearn.serving.engine import stats_with_hit_rate
from kvlearn.serving.request import Request
from kvlearn.serving.simulate import SimEngine
from kvlearn.tiers.host import host_pool_for
from kvlearn.tiers.manager import TieredRadixKV


def simulate_tiers(rounds, num_slots: int, host_slots: int | None = None, write_policy: str = "write_back",
                   max_new_tokens: int = 8) -> dict:
    """Serve `rounds` (a list of lists of prompts) on one tiered radix manager; return the stats of
    `Engine.stats` (wall time 0) summed over the rounds."""
    pool = KVPool(1, 1, 1, num_slots)
    kv = TieredRadixKV(pool, host=host_pool_for(pool, host_slots) if host_slots else None, write_policy=write_policy)
    sim = SimEngine(kv, filler=0)
    rid = 0
    for prompts in rounds:
        for prompt in prompts:
            sim.add(Request(rid, list(prompt), max_new_tokens))
            rid += 1
        if prompts:
            sim.filler = prompts[-1][-1]   # a token of the round's last prompt: never an end of sequence
            sim.run()
    return stats_with_hit_rate(sim.stats, 0.0) | kv.counters()
