"""The serving engine: scheduling and cache bookkeeping (with a stand-in model that checks every
KV read), then the real model against Hugging Face `generate`, memory pressure and bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlearn.errors import KVCapacityError
from kvlearn.parts import RadixCacheBase
from kvlearn.pool import KVPool
from kvlearn.serving.cache_modes import CACHE_MODES, make_kv_manager
from kvlearn.serving.config import DEFAULT_NUM_SLOTS, EngineConfig
from kvlearn.serving.engine import Engine
from kvlearn.serving.request import Request
from kvlearn.serving.scheduler import SCHEDULES, Scheduler
from kvlearn.serving.simulate import simulate
from kvlearn.serving.workloads import make_workload, unique_token_floor
from tests.hf_reference import hf_greedy

# --- a stand-in model that proves the KV it reads is the right one --------------------------------
VOCAB, EOS = 50, 0


def next_token(context) -> int:
    """A deterministic 'model': the next token is a hash of the whole context."""
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def reference(prompt, max_new_tokens, eos=EOS):
    context, out = list(prompt), []
    while len(out) < max_new_tokens:
        out.append(next_token(context))
        context.append(out[-1])
        if out[-1] == eos:
            break
    return out


class RecordingForward:
    """Writes each new token's id and position at its slot, and rebuilds every sequence's context
    from the slots it is told to read: a wrong, stale or shared-by-mistake slot changes the
    context, hence the next token, hence the test result."""

    def __init__(self, num_slots: int, eos=EOS):
        self.token = torch.full((num_slots,), -1, dtype=torch.int64)
        self.position = torch.full((num_slots,), -1, dtype=torch.int64)
        self.eos = eos

    def __call__(self, batch) -> list[int]:
        out = []
        for ids, slots in zip(batch.input_ids, batch.kv_indices, strict=True):
            cached = len(slots) - len(ids)
            assert torch.equal(self.position[slots[:cached]], torch.arange(cached)), "context read from wrong slots"
            context = self.token[slots[:cached]].tolist() + list(ids)
            self.token[slots[cached:]] = torch.tensor(ids)
            self.position[slots[cached:]] = torch.arange(cached, len(slots))
            out.append(next_token(context))
        return out


def run_scheduler(prompts, cache="radix", num_slots=4096, page_size=1, max_new_tokens=8, schedule="fcfs",
                  max_batch_tokens=2048, in_batch_threshold=1, eos=EOS, chunked_prefill=True):
    pool = KVPool(1, 1, 1, num_slots, page_size=page_size)
    kv = make_kv_manager(cache, pool)
    scheduler = Scheduler(kv, max_batch_tokens, schedule, (eos,), in_batch_threshold=in_batch_threshold,
                          chunked_prefill=chunked_prefill)
    forward = RecordingForward(num_slots, eos)
    requests = [Request(i, p, max_new_tokens, page_size) for i, p in enumerate(prompts)]
    for req in requests:
        scheduler.add(req)
    reports = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert len(batch) > 0, "a step with nothing to run: the scheduler is stuck"
        scheduler.postprocess(batch, forward(batch))  # postprocess asserts slot conservation
        reports.append(scheduler.report)
        assert len(reports) < 10_000
    return requests, reports, scheduler, pool


def assert_all_free_after_evict(scheduler, pool):
    """Every slot is the cache's or free, and free once the cache is evicted, in every mode: one
    allocator, the pool's, owns them all."""
    kv = scheduler.kv
    assert pool.num_free + kv.evictable_slots == pool.num_slots
    kv.evict_all()
    assert pool.num_free == pool.num_slots and kv.rows.num_free == len(kv.rows.lengths)
    if kv.name == "blocks":
        assert not kv.manager.hash_to_block_id and kv.manager.num_free_blocks == kv.manager.num_blocks
    if kv.name == "radix":
        kv.tree.check_invariants()
        assert kv.tree.total_size == 0


@st.composite
def scenarios(draw):
    cache = draw(st.sampled_from(CACHE_MODES))
    page_size = draw(st.sampled_from([1, 2, 4] if cache != "blocks" else [1, 2, 4, 8]))
    tokens = st.integers(1, VOCAB - 1)
    base = draw(st.lists(tokens, max_size=14))
    prompts = draw(st.lists(st.builds(lambda k, tail: base[:k] + tail, st.integers(0, len(base)),
                                      st.lists(tokens, min_size=1, max_size=10)), min_size=1, max_size=8))
    max_new_tokens = draw(st.integers(1, 10))
    need = max(len(p) + max_new_tokens - 1 for p in prompts)
    num_slots = (-(-need // page_size) + draw(st.integers(0, 30))) * page_size
    return dict(prompts=prompts, cache=cache, page_size=page_size, max_new_tokens=max_new_tokens,
                num_slots=num_slots, schedule=draw(st.sampled_from(SCHEDULES)),
                max_batch_tokens=draw(st.sampled_from([1, 5, 16, 2048])),
                in_batch_threshold=draw(st.sampled_from([0, 1, 8])), chunked_prefill=draw(st.booleans()))


@given(scenarios())
def test_property_any_pool_any_cache_gives_the_reference_tokens(case):
    """Tight pools, pages, budgets and policies: every request gets exactly the tokens it would get
    alone, every KV read is the right one, slots are conserved every step, nothing leaks."""
    requests, reports, scheduler, pool = run_scheduler(**case)
    for req, prompt in zip(requests, case["prompts"], strict=True):
        assert req.status == "finished"
        assert req.output_ids == reference(prompt, case["max_new_tokens"])
    stats = scheduler.stats
    assert stats["output_tokens"] == sum(len(r.output_ids) for r in requests)
    if stats["preemptions"] == 0:
        assert stats["cached_tokens"] + stats["computed_prefill_tokens"] == stats["prompt_tokens"]
    if case["cache"] == "none":
        assert stats["cached_tokens"] == 0 and stats["evicted_tokens"] == 0
    assert_all_free_after_evict(scheduler, pool)


def test_shared_prefix_is_computed_once_even_when_admitted_together():
    shared = list(range(1, 41))
    prompts = [shared + [41 + i, 42 + i] for i in range(6)]
    floor = unique_token_floor(prompts)
    _, reports, scheduler, _ = run_scheduler(prompts, cache="radix")
    assert scheduler.stats["computed_prefill_tokens"] == floor == 40 + 6 * 2  # suffixes all differ
    assert reports[0].deferred == [1, 2, 3, 4, 5]  # they wait one step for r0's prefix
    assert [r for r, _, _ in reports[1].prefills] == [1, 2, 3, 4, 5]
    # Without the in-batch check the prefix is computed six times.
    _, _, scheduler, _ = run_scheduler(prompts, cache="radix", in_batch_threshold=0)
    assert scheduler.stats["computed_prefill_tokens"] == 6 * 42
    # Blocks share whole blocks only: at least the floor, at most one partial block more per prompt.
    _, _, scheduler, _ = run_scheduler(prompts, cache="blocks", page_size=8)
    assert floor <= scheduler.stats["computed_prefill_tokens"] <= floor + 6 * 8


def test_full_hit_still_computes_the_last_token():
    prompt = list(range(1, 30))
    requests, reports, scheduler, _ = run_scheduler([prompt, prompt], cache="radix", max_new_tokens=3)
    assert reports[0].deferred == [1]
    second = [p for rep in reports for p in rep.prefills if p[0] == 1][0]
    assert second == (1, len(prompt) - 1, 1)
    assert requests[0].output_ids == requests[1].output_ids == reference(prompt, 3)


def test_lpm_admits_the_longest_cached_prefix_first():
    cached = list(range(1, 31))
    first, other, sharer = cached + [31], list(range(100, 130)), cached + [32]
    order = {}
    for schedule in SCHEDULES:
        pool = KVPool(1, 1, 1, 256)
        # Without chunks, so that the second request cannot take the rest of the budget.
        scheduler = Scheduler(make_kv_manager("radix", pool), max_batch_tokens=31, schedule=schedule,
                              chunked_prefill=False)
        forward = RecordingForward(256)
        scheduler.add(Request(0, first, 2))
        batch = scheduler.schedule()
        scheduler.postprocess(batch, forward(batch))  # r0's prompt is now in the tree
        scheduler.add(Request(1, other, 2))
        scheduler.add(Request(2, sharer, 2))
        scheduler.schedule()  # budget 30 after r0's decode: r1 (30 to compute) or r2 (1), not both
        order[schedule] = [r for r, _, _ in scheduler.report.prefills]
    assert order == {"fcfs": [1], "lpm": [2]}


def test_pressure_evicts_then_preempts_the_newest_and_recovers():
    prompts = [[i + 1] * 6 + [40 + i] for i in range(4)]
    requests, reports, scheduler, pool = run_scheduler(prompts, cache="radix", num_slots=16, max_new_tokens=8,
                                                       eos=-1)
    preempted = [rid for rep in reports for rid in rep.preempted]
    assert preempted and scheduler.stats["evicted_tokens"] > 0
    first_preemption = next(rep for rep in reports if rep.preempted)
    # the victim is the most recently admitted of the requests running at that step
    admitted = [rid for rep in reports[:first_preemption.step - 1] for rid, _, _ in rep.prefills]
    assert first_preemption.preempted[0] == admitted[-1]
    assert all(r.output_ids == reference(p, 8, eos=-1) for r, p in zip(requests, prompts, strict=True))
    assert_all_free_after_evict(scheduler, pool)


def test_a_refused_admission_keeps_the_cache():
    """A request that cannot fit even after evicting everything unlocked is refused without
    evicting anything: the cached prefix is still there for the next request that can use it."""
    kv = make_kv_manager("radix", KVPool(1, 1, 1, 64))
    scheduler = Scheduler(kv, schedule="lpm")
    shared = list(range(100, 130))

    def step():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [7] * len(batch))

    scheduler.add(Request(0, shared, 1))
    step()
    assert kv.evictable_slots == 30
    scheduler.add(Request(1, list(range(200, 210)), 20))
    scheduler.add(Request(2, list(range(300, 360)), 2))  # 61 slots: never fits while r1 runs
    step()
    assert kv.evictable_slots == 30 and scheduler.stats["evicted_tokens"] == 0
    scheduler.add(Request(3, shared + [5], 4))
    step()
    assert scheduler.report.prefills[0][:2] == (3, 30)  # r3 reused the 30 cached tokens
    while scheduler.has_unfinished():
        step()
    assert kv.free_slots + kv.evictable_slots == 64


def test_simulate_rejects_what_could_never_run():
    with pytest.raises(KVCapacityError, match="num_slots"):
        simulate([list(range(1, 11))], "radix", max_new_tokens=2, num_slots=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        simulate([[1, 2, 3]], "none", max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        simulate([[1, 2], []], "none")


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_a_long_prompt_is_chunked_while_the_others_keep_decoding(cache):
    short, long = [[1, 2, 3], [4, 5, 6]], list(range(7, 47))  # 40 tokens, budget 16
    page = 4 if cache == "blocks" else 1
    requests, reports, _, _ = run_scheduler(short + [long], cache=cache, page_size=page, max_new_tokens=6,
                                            max_batch_tokens=16)
    assert [r.output_ids for r in requests] == [reference(p, 6) for p in short + [long]]
    # Step 1 admits the short prompts and the first chunk; the rest follows a chunk per step, each
    # step beside the short requests' decodes, and the prompt's first token comes after its last chunk.
    assert reports[0].prefills == [(0, 0, 3), (1, 0, 3), (2, 0, 10)]
    assert [c for rep in reports for c in rep.chunks] == [(2, 10, 14), (2, 24, 14), (2, 38, 2)]
    assert all(rep.decodes[:2] == [0, 1] for rep in reports[1:4])
    assert "chunk r2 (tokens 10-23)" in repr(reports[1])
    # Without chunks the long prompt waits for the short ones to finish, then runs alone, whole.
    requests, reports, _, _ = run_scheduler(short + [long], cache=cache, page_size=page, max_new_tokens=6,
                                            max_batch_tokens=16, chunked_prefill=False)
    assert [r.output_ids for r in requests] == [reference(p, 6) for p in short + [long]]
    alone = next(rep for rep in reports if any(r == 2 for r, _, _ in rep.prefills))
    assert alone.prefills == [(2, 0, 40)] and alone.decodes == [] and alone.step == 7


def test_a_preempted_chunked_prompt_keeps_its_computed_chunks_in_the_cache():
    """Preempted half way through its prompt, a request gives its computed chunks to the radix tree,
    and re-admitted it finds them there."""
    pool = KVPool(1, 1, 1, 64)
    scheduler = Scheduler(make_kv_manager("radix", pool), max_batch_tokens=10)
    forward = RecordingForward(64)
    req = Request(0, list(range(1, 31)), 4)
    scheduler.add(req)
    for _ in range(2):
        batch = scheduler.schedule()
        scheduler.postprocess(batch, forward(batch))
    assert req.num_computed == 20 and req.status == "running"
    scheduler.preempt(req)
    assert scheduler.kv.cached_len(req.token_ids) == 20
    batch = scheduler.schedule()
    assert scheduler.report.prefills == [(0, 20, 10)]
    scheduler.postprocess(batch, forward(batch))
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, forward(batch))
    assert req.output_ids == reference(list(range(1, 31)), 4)


def test_scheduler_rejects_bad_settings():
    pool = KVPool(1, 1, 1, 8)
    with pytest.raises(ValueError, match="schedule"):
        Scheduler(make_kv_manager("none", pool), schedule="sjf")
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Scheduler(make_kv_manager("none", pool), max_batch_tokens=0)
    with pytest.raises(ValueError, match="cache"):
        make_kv_manager("lru", pool)
    with pytest.raises(ValueError, match="page_size"):  # blocks are pages: the pool must hold whole ones
        KVPool(1, 1, 1, 10, page_size=4)
    with pytest.raises(TypeError, match="in_batch_threshold must be an int"):
        Scheduler(make_kv_manager("none", pool), in_batch_threshold=None)


def test_engine_config_is_checked_once_with_clear_errors():
    """Every option is a field of EngineConfig, checked when the config is made; sizes left None
    get their defaults; keyword options replace a config's fields; a misspelt option is named."""
    blocks = EngineConfig(cache="blocks")
    assert (blocks.page_size, blocks.num_slots, blocks.tiered) == (16, DEFAULT_NUM_SLOTS, False)
    assert EngineConfig.from_options(blocks, max_batch_tokens=64).max_batch_tokens == 64
    assert EngineConfig(host_slots=64).tiered and blocks.max_batch_tokens == 2048  # the original is untouched
    bad = [(dict(cache="lru"), ValueError, "Unknown cache 'lru'"),
           (dict(schedule="sjf"), ValueError, "Unknown schedule"),
           (dict(write_policy="later"), ValueError, "Unknown write_policy"),
           (dict(max_batch_tokens=0), ValueError, "max_batch_tokens must be >= 1"),
           (dict(max_requests=True), TypeError, "max_requests must be an int"),
           (dict(host_slots=-4), ValueError, "host_slots must be >= 1"),
           (dict(disk_max_bytes=1024), ValueError, "give disk_dir too"),
           (dict(cache="blocks", host_slots=64), ValueError, "need cache='radix'"),
           (dict(chunked_prefill="no"), TypeError, r"chunked_prefill must be True or False, got str 'no': pass "
                                                   "chunked_prefill=True or chunked_prefill=False"),
           (dict(fast="yes"), TypeError, "fast must be True or False, got str 'yes'"),
           (dict(plain_text=None), TypeError, "plain_text must be True or False, got NoneType None"),
           (dict(parts={"radix_cache": RadixCacheBase}), TypeError, r"parts\['radix_cache'\] \(RadixCacheBase\) "
                                                                    "lacks evict, insert, lock, match_prefix, unlock: "
                                                                    r"the radix_cache contract "
                                                                    r"\(kvlearn.parts.RadixCachePart\)"),
           (dict(parts={"allocator": dict}), TypeError, r"parts\['allocator'\] \(dict\) lacks alloc, free, "
                                                        "free_pages, is_free, num_free"),
           (dict(parts={"block_manager": object}, cache="blocks"), TypeError, "lacks allocate, can_allocate"),
           (dict(parts={"attention": object}), TypeError, "is a function like kvlearn.attention.paged_attention")]
    for options, error, message in bad:
        with pytest.raises(error, match=message):
            EngineConfig(**options)
    with pytest.raises(TypeError, match="Unknown engine option.* num_slot: the options are cache, num_slots"):
        EngineConfig.from_options(num_slot=64)
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        EngineConfig.from_options({"cache": "none"})


# --- the real model ------------------------------------------------------------------------------
MAX_NEW = 8
SMALL = {"shared_system": dict(num_requests=3), "short_system": dict(num_requests=3), "few_shot": dict(num_requests=4),
         "multi_turn": dict(num_conversations=2, num_turns=2), "branching": dict(num_branches=2, num_leaves=1),
         "no_sharing": dict(num_requests=3)}


@pytest.fixture(scope="module")
def workloads(tokenizer):
    return {name: make_workload(name, tokenizer, **sizes) for name, sizes in SMALL.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name, cache", [   # one of them is `make quick`'s smoke test
    pytest.param(name, cache, marks=[pytest.mark.smoke] if (name, cache) == ("short_system", "radix") else [])
    for name in sorted(SMALL) for cache in CACHE_MODES])
def test_engine_matches_hf_generate(model, tokenizer, workloads, name, cache):
    workload = workloads[name]
    engine = Engine(model, tokenizer, cache=cache, num_slots=4096)
    outputs = engine.generate(workload.prompt_lists(), max_new_tokens=MAX_NEW)
    for out, prompt in zip(outputs, workload.prompts, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, MAX_NEW)
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    stats = engine.stats
    assert stats["prompt_tokens"] == workload.num_prompt_tokens
    assert stats["cached_tokens"] + stats["computed_prefill_tokens"] == workload.num_prompt_tokens
    if cache == "radix":  # the in-batch check makes radix compute exactly the floor here
        assert stats["computed_prefill_tokens"] == workload.unique_token_floor
    elif cache == "blocks":
        assert stats["computed_prefill_tokens"] >= workload.unique_token_floor
    else:
        assert stats["computed_prefill_tokens"] == workload.num_prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("cache", CACHE_MODES)
def test_memory_pressure_same_tokens_and_no_leak(model, tokenizer, cache):
    """A pool of 20% of what the workload needs without sharing: requests are evicted and
    preempted, and still produce Hugging Face's tokens; nothing leaks."""
    workload = make_workload("no_sharing", tokenizer, num_requests=8)
    max_new = 12
    need = sum(len(p) + max_new for p in workload.prompts)
    page = 4 if cache == "blocks" else 1
    engine = Engine(model, tokenizer, cache=cache, num_slots=int(0.2 * need) // page * page, page_size=page)
    outputs = engine.generate(workload.prompt_lists(), max_new_tokens=max_new)
    for out, prompt in zip(outputs, workload.prompts, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, max_new)
    stats = engine.stats
    assert stats["preemptions"] > 0
    assert (stats["evicted_tokens"] > 0) == (cache != "none")
    assert not engine.has_unfinished() and stats["peak_slots"] <= engine.pool.num_slots
    kv = engine.kv
    assert kv.free_slots + kv.evictable_slots == engine.pool.num_slots
    engine.evict_all()
    assert kv.free_slots == engine.pool.num_slots


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True])
def test_lpm_and_string_prompts_and_model_left_unchanged(model, tokenizer, fast, monkeypatch):
    from kvlearn.model import chat_ids

    question = "Name a colour."
    ids = chat_ids(tokenizer, question)
    before = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    attn = model.config._attn_implementation
    switches = []
    original = type(model).set_attn_implementation
    monkeypatch.setattr(type(model), "set_attn_implementation",
                        lambda self, name: switches.append(name) or original(self, name))
    engine = Engine(model, tokenizer, cache="radix", schedule="lpm", num_slots=512, fast=fast)
    outputs = engine.generate([question, ids], max_new_tokens=6)
    # once in and once out per generate on the plain path, never on the fast one (not per step)
    assert switches == ([] if fast else ["kvlearn_paged", attn])
    assert outputs[0].token_ids == outputs[1].token_ids == before[0, len(ids):].tolist()
    assert outputs[0].prompt_token_ids == ids
    monkeypatch.undo()
    after = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert torch.equal(before, after) and model.config._attn_implementation == attn
    assert all(torch.equal(p, params[name]) for name, p in model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True])
def test_chunked_prefill_gives_hf_tokens(model, tokenizer, workloads, fast):
    """Prompts of about 320 tokens through a 64-token budget: each is computed in chunks, over its
    own earlier chunks and the cached system prompt, and the tokens are still Hugging Face's."""
    workload = workloads["shared_system"]
    engine = Engine(model, tokenizer, cache="radix", num_slots=2048, max_batch_tokens=64, fast=fast)
    outputs = engine.generate(workload.prompt_lists(), max_new_tokens=4)
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, 4) for p in workload.prompts]
    stats = engine.stats
    assert stats["cached_tokens"] + stats["computed_prefill_tokens"] == workload.num_prompt_tokens
    assert stats["steps"] >= workload.unique_token_floor // 64  # no step computed more than the budget


@pytest.mark.slow
def test_step_by_step_matches_generate(model, tokenizer, workloads):
    prompts = workloads["shared_system"].prompt_lists()[:2]
    engine = Engine(model, tokenizer, cache="radix", num_slots=1024)
    requests = [engine.add_request(p, max_new_tokens=3) for p in prompts]
    reports = []
    while engine.has_unfinished():
        reports.append(engine.step())
    assert [r.output_ids for r in requests] == [hf_greedy(model, p, 3) for p in prompts]
    assert reports[0].prefills == [(0, 0, len(prompts[0]))] and reports[0].deferred == [1]
    assert "prefill r1" in repr(reports[1]) and "decode r0" in repr(reports[1])
    assert engine.stats["steps"] == len(reports)


def test_bad_input_is_rejected_and_the_engine_still_works(model, tokenizer):
    with pytest.raises(ValueError, match="cache"):
        Engine(model, tokenizer, cache="lru")
    with pytest.raises(ValueError, match="schedule"):
        Engine(model, tokenizer, schedule="random")
    with pytest.raises(ValueError, match="num_slots"):
        Engine(model, tokenizer, num_slots=0)
    with pytest.raises(ValueError, match="multiple of page_size"):
        Engine(model, tokenizer, cache="blocks", num_slots=100, page_size=16)
    engine = Engine(model, tokenizer, cache="radix", num_slots=64)
    ok = [1, 9690, 198, 30]
    bad_calls = [
        (ValueError, "Empty prompt", lambda: engine.generate([ok, []])),
        (ValueError, "Empty prompt", lambda: engine.generate([""])),
        (ValueError, "outside the vocabulary", lambda: engine.generate([ok, [1, model.config.vocab_size]])),
        (ValueError, ">= 0", lambda: engine.generate([[-1, 2]])),
        (TypeError, "must be ints", lambda: engine.generate([[1.0, 2]])),
        (ValueError, "max_new_tokens", lambda: engine.generate([ok], max_new_tokens=0)),
        (KVCapacityError, "whole pool", lambda: engine.generate([ok, list(range(1, 70))], max_new_tokens=2)),
        (KVCapacityError, "whole pool", lambda: engine.add_request(ok, max_new_tokens=100)),
        (TypeError, "list of prompts", lambda: engine.generate("hello")),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()
        assert not engine.has_unfinished() and engine.pool.num_free == 64 and engine.cache.total_size == 0
    out = engine.generate([ok], max_new_tokens=2)
    assert out[0].token_ids == hf_greedy(model, ok, 2)
    with pytest.raises(RuntimeError, match="Nothing to run"):
        engine.step()


def test_a_pool_too_big_for_memory_is_refused_with_an_estimate(model, tokenizer):
    with pytest.raises(MemoryError, match=r"A KV pool of 1,000,000,000,000 slots needs about 42,915,344.24 GiB "
                                          r"\(46,080 bytes per token\) but about [\d,.]+ GiB of cpu memory are "
                                          r"available: use a smaller num_slots \(about [\d,]+ would fill it all\)"):
        Engine(model, tokenizer, num_slots=10**12)


def test_a_closed_engine_refuses_to_serve(model, tokenizer):
    with Engine(model, tokenizer, num_slots=64) as engine:
        engine.add_request([1, 9690, 198, 30], max_new_tokens=2)
    assert not engine.has_unfinished()   # close() aborted the queued request
    for call in (lambda: engine.generate([[1, 2]]), lambda: engine.add_request([1, 2]), engine.step, engine.evict_all):
        with pytest.raises(RuntimeError, match=r"this Engine is closed \(close\(\), or the end of its `with` block\); "
                                               "build a new Engine to serve again"):
            call()
    engine.close()   # idempotent


@pytest.mark.slow
def test_generate_while_earlier_requests_run_counts_them_whole(model, tokenizer):
    engine = Engine(model, tokenizer, cache="radix", num_slots=1024)
    first = engine.add_request("Tell me a long story about a dragon.", max_new_tokens=12)
    engine.step()
    engine.generate(["Hi"], max_new_tokens=2)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats
    assert first.status == "finished" and stats["requests"] == 2
    assert stats["cached_tokens"] + stats["computed_prefill_tokens"] == stats["prompt_tokens"]
