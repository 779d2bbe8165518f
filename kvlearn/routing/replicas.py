"""The replicas of a fleet: what the event loop (`kvlearn.routing.fleet`) drives and the router asks.

`SimReplica` is chapter 6's model-free driver (`SimEngine`: a slots-only pool, every request
"generates" the answer its trace recorded, then a filler token); `EngineReplica` wraps a real
`Engine`. Both `submit` a trace request, run one `step`, say whether they have unfinished work and
which prompts routed to them are not cached yet (`waiting_prompts`), and expose their KV manager
(`kv`) and `stats`; `known_prefix_len` is what a router fed by KV events knows of either.
"""

from __future__ import annotations

from itertools import chain

from kvlearn.pool import KVPool
from kvlearn.routing.pooled import PooledRadixKV, PrefixPool
from kvlearn.routing.trace_request import TraceRequest
from kvlearn.serving.cache_modes import default_page_size, make_kv_manager
from kvlearn.serving.kv_manager import DEFAULT_MAX_REQUESTS
from kvlearn.serving.prefixes import common_prefix_len
from kvlearn.serving.request import Request, RequestStatus
from kvlearn.serving.simulate import SimEngine

FILLER_TOKEN = 0  # what a simulated request generates past its recorded answer; generated traces never use it


class SimReplica(SimEngine):
    """A replica without the model: chapter 6's `SimEngine` (a real Scheduler and KV manager on a
    pool of bare slots) for one cache mode. Each request generates the answer its trace recorded."""

    def __init__(self, cache: str = "radix", num_slots: int = 16384, page_size: int | None = None,
                 max_batch_tokens: int = 2048, schedule: str = "fcfs", max_requests: int | None = None,
                 shared: PrefixPool | None = None):
        page_size = default_page_size(cache) if page_size is None else page_size
        pool = KVPool(1, 1, 1, num_slots, page_size=page_size, device="cpu")
        # max_requests: requests that may run at once (rows of the KV manager's request table);
        # None keeps the engine's default, which real-engine comparisons need
        rows = DEFAULT_MAX_REQUESTS if max_requests is None else max_requests
        if shared is None:
            kv = make_kv_manager(cache, pool, rows)
        elif cache == "radix":   # a pooled fleet: this replica's radix cache over the shared pool
            kv = PooledRadixKV(pool, shared, rows)
        else:
            raise ValueError(f"A shared pool sits below the radix cache mode, not {cache!r}.")
        super().__init__(kv, FILLER_TOKEN, max_batch_tokens=max_batch_tokens, schedule=schedule)
        self.page_size = page_size

    def submit(self, rid: int, treq: TraceRequest) -> Request:
        return self.add(Request(rid, treq.prompt_ids, treq.max_new_tokens, page_size=self.page_size), treq.answer)

    def waiting_prompts(self):
        """Prompts routed here that are not in the cache yet: waiting, or admitted and still being
        computed in chunks (a prompt joins the cache after its last chunk)."""
        sched = self.scheduler
        return chain((req.token_ids for req in sched.waiting),
                     (req.token_ids for req in sched.running if req.prefilling))


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
        progressed = [r for r, n in zip(self.live, before, strict=True) if len(r.token_ids) > n]
        self.live = [r for r in self.live if r.status != RequestStatus.FINISHED]
        return progressed

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def waiting_prompts(self):
        return (req.token_ids for req in self.live
                if req.status == RequestStatus.WAITING or (req.status == RequestStatus.RUNNING and req.prefilling))

    @property
    def stats(self) -> dict:
        return self.engine.stats


def known_prefix_len(replica, prompt: list[int]) -> int:
    """What a router fed by KV events knows a replica will have for `prompt` by the time it runs:
    its real cache (`cached_len`), or the prefix shared with a request routed there whose prompt is
    not cached yet, waiting or still computing in chunks (Dynamo's router counts its in-flight
    requests' blocks the same way)."""
    waiting = (common_prefix_len(prompt[:-1], other) for other in replica.waiting_prompts())
    return max(replica.kv.cached_len(prompt), max(waiting, default=0))
