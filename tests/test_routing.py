"""Chapter 7, model-free units: the trace generator and reader, and each routing policy."""

import gzip
import itertools
import json
import math
import random
import re
import signal
from contextlib import contextmanager

import pytest

from kvlearn.routing import budget, jsonlines
from kvlearn.routing.cli import main as route
from kvlearn.routing.policies import (
    POLICIES,
    ApproxTree,
    CacheAware,
    Exact,
    LeastLoad,
    PrefixHash,
    RandomChoice,
    RoundRobin,
    RouterView,
    make_policy,
    router_page_hashes,
)
from kvlearn.routing.trace_request import TraceError, TraceRequest
from kvlearn.routing.traces import multi_tenant_trace, read_trace, tenant_of, unique_token_floor, write_trace
from kvlearn.serving.prefixes import common_prefix_len
from kvlearn.serving.prefixes import unique_token_floor as floor_of_prompts


def req(prompt, rid="r"):
    return TraceRequest(rid, 0.0, (tuple(prompt),), 4)


def view(n, inflight=None, outstanding=None, cached=None):
    return RouterView(list(inflight or [0] * n), list(outstanding or [0] * n),
                      cached_len=(lambda i, p: cached[i]) if cached else None)


# --- traces ----------------------------------------------------------------------------------------

def test_generator_is_seeded_sorted_and_multi_turn():
    a, b = multi_tenant_trace(300, seed=3), multi_tenant_trace(300, seed=3)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    assert multi_tenant_trace(300, seed=4)[0].prompt_ids != a[0].prompt_ids
    by_session = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r)
    turns = [s for s in by_session.values() if len(s) > 1]
    assert turns, "some sessions have several turns"
    for s in turns:   # every turn resends the previous one, followed by its answer
        for before, after in itertools.pairwise(s):
            assert (after.prompt_ids[:before.num_prompt_tokens + len(before.answer)] ==
                    before.prompt_ids + list(before.answer))


def test_generated_ids_are_drawn_as_randrange_draws_them():
    from kvlearn.routing.traces import FIRST_TOKEN_ID, VOCAB_SIZE, _tokens
    for seed in range(5):
        for n in (0, 1, 7, 500):
            fast, slow = random.Random(seed), random.Random(seed)
            assert _tokens(fast, n) == tuple(slow.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(n))
            assert fast.random() == slow.random()   # and the generator is left in the same state


def test_hot_tenant_takes_its_share():
    trace = multi_tenant_trace(2000, num_tenants=32, hot_tenant_share=0.5, seed=1)
    share = sum(tenant_of(r) == "tenant0" for r in trace) / len(trace)
    assert 0.45 < share < 0.7   # 0.5 on top of its Zipf share


def brute_force_floor(trace) -> int:
    """The floor's definition, prefix by prefix in arrival order: a prompt prefix counts unless an
    earlier prompt, or an earlier request's prompt + the answer tokens it fed back, already held it."""
    seen, floor = set(), 0
    for r in trace:
        prompt = tuple(r.prompt_ids)
        new = {prompt[:k] for k in range(1, len(prompt) + 1)} - seen
        floor += len(new)
        seen |= new
        fed_back = prompt + tuple(r.answer[:r.max_new_tokens - 1])   # the last sampled token is never fed back
        seen |= {fed_back[:k] for k in range(len(prompt) + 1, len(fed_back) + 1)}
    return floor


def test_floor_of_parts_is_the_brute_force_floor():
    trace = multi_tenant_trace(120, num_tenants=4, system_tokens=(20, 200), seed=0)
    assert any(r.answer for r in trace)
    assert unique_token_floor(trace) == brute_force_floor(trace)
    # the answers resent by later turns are what separates it from chapter 6's floor over prompts;
    # the last turns kept (the trace is cut at 120 requests) have answers nobody resends
    resent = sum(min(len(r.answer), r.max_new_tokens - 1) for r in trace)
    assert floor_of_prompts([r.prompt_ids for r in trace]) - resent < unique_token_floor(trace) < \
        floor_of_prompts([r.prompt_ids for r in trace])


def test_common_prefix_len_is_the_first_mismatch():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(tuple(b), tuple(a)) == first


def test_floor_counts_a_resent_answer_by_hand(tmp_path):
    # turn 1: prompt 1 2 3, answers 4 5 6 (three tokens); turn 2 resends it all and asks 7.
    # Prompt prefixes: 1, 12, 123, 1234, ..., 1234567 (7). Turn 1 fed back 4 and 5 while decoding
    # (6 was sampled last, never fed back), so 1234 and 12345 were computed then: floor 7 - 2 = 5.
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"id": "t1", "arrival": 0, "prompt_ids": [1, 2, 3], "max_new_tokens": 3,
                                "session": "s"}) + "\n" +
                    json.dumps({"id": "t2", "arrival": 60, "prompt_ids": [1, 2, 3, 4, 5, 6, 7],
                                "max_new_tokens": 2, "session": "s"}) + "\n")
    trace = read_trace(path)
    assert trace[0].answer == (4, 5, 6) and unique_token_floor(trace) == brute_force_floor(trace) == 5
    from kvlearn.routing.fleet import simulate_fleet
    r = simulate_fleet(trace, "round_robin", 1, slots_per_replica=64)
    assert r.computed_prefill_tokens == 5   # turn 2 finds 1 2 3 4 5 cached and computes 6 and 7


def test_write_then_read_gives_the_same_trace_and_answers(tmp_path):
    trace = multi_tenant_trace(100, seed=2)
    back = read_trace(write_trace(trace, tmp_path / "t.jsonl"))
    assert [(r.id, r.prompt_ids, r.max_new_tokens, r.session) for r in back] == \
           [(r.id, r.prompt_ids, r.max_new_tokens, r.session) for r in trace]
    for r, s in zip(back, trace, strict=True):   # answers re-derived from the sessions' next turns
        assert not r.answer or r.answer == s.answer[:len(r.answer)]
    assert any(r.answer for r in back)


def test_reader_sorts_by_arrival_and_tokenizes_text(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "b", "arrival": 2.0, "prompt": "Hello", "max_new_tokens": 3}\n\n'
                    '{"id": "a", "arrival": 1, "prompt_ids": [5, 6, 7], "max_new_tokens": 2, "session": "x"}\n')
    a, b = read_trace(path, tokenizer=tokenizer)
    assert (a.id, a.prompt_ids, a.session, a.line) == ("a", [5, 6, 7], "x", 3)
    from kvlearn.model import chat_ids
    assert b.prompt_ids == chat_ids(tokenizer, "Hello")


BAD_LINES = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1, "tenant": "x"}', "unknown field(s) 'tenant'"),
    ('{"id": "a", "prompt_ids": [1], "max_new_tokens": 1}', "missing field 'arrival'"),
    ('{"id": 7, "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1}', "'id' must be a non-empty string"),
    ('{"id": "a", "arrival": -1, "prompt_ids": [1], "max_new_tokens": 1}',
     "'arrival' must be a number of seconds >= 0"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 0}', "'max_new_tokens' must be an int >= 1"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [], "max_new_tokens": 1}', "'prompt_ids' must be a non-empty list"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1, -2], "max_new_tokens": 1}', "found -2"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1, 49152], "max_new_tokens": 1}', "< 49152, found 49152"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1], "prompt": "x", "max_new_tokens": 1}', "exactly one of"),
    ('{"id": "a", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1, "session": 3}', "'session' must be a string"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_is_reported_with_its_number(tmp_path, line, message):
    good = '{"id": "ok", "arrival": 0, "prompt_ids": [1, 2], "max_new_tokens": 1}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert "t.jsonl:2: " in str(e.value) and message in str(e.value)


def test_all_bad_lines_reported_at_once_and_duplicates_named(tmp_path):
    good = '{"id": "%s", "arrival": 0, "prompt_ids": [1], "max_new_tokens": 1}'
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([good % "a", "{", good % "a", good % "b"]) + "\n")
    with pytest.raises(TraceError, match=r"2 bad line\(s\)") as e:
        read_trace(path)
    assert ":2: not valid JSON" in str(e.value) and ":3: id 'a' already used on line 1" in str(e.value)


def test_missing_and_empty_trace_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="No trace file"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_generator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_requests"):
        multi_tenant_trace(0)
    with pytest.raises(ValueError, match="hot_tenant_share"):
        multi_tenant_trace(10, hot_tenant_share=1.0)


@contextmanager
def within(seconds: float):
    """Fail, instead of hanging, when the block runs longer than `seconds`."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name,value", [
    ("rate", math.nan), ("rate", math.inf), ("rate", 0.0), ("rate", -1.0), ("rate", 1e-300),
    ("burstiness", math.nan), ("burstiness", math.inf), ("burstiness", 1e-200), ("burstiness", 1e200),
    ("burstiness", 0.0), ("mean_turns", math.inf), ("mean_turns", math.nan), ("think_time_s", math.inf),
    ("think_time_s", math.nan), ("zipf_s", math.nan), ("zipf_s", -1.0), ("fewshot_share", math.nan),
    ("hot_tenant_share", math.inf), ("system_tokens", (0, 10)), ("question_tokens", (9, 3)),
    ("output_tokens", (1.5, 3)),
])
def test_generator_refuses_every_number_it_cannot_draw_from(name, value):
    # burstiness nan once looped forever in random.gammavariate; 1e-200 and inf divided by zero
    with within(10), pytest.raises(ValueError, match=name):
        multi_tenant_trace(20, **{name: value})


def test_generator_refuses_a_trace_beyond_memory_before_drawing(monkeypatch):
    monkeypatch.setattr(budget, "available_bytes", lambda: (50 * 2**20, None))
    with within(10), pytest.raises(MemoryError, match=r"1,000,000 tenants would take about [\d.,]+ GB"):
        multi_tenant_trace(10, num_tenants=10**6)
    assert len(multi_tenant_trace(10, num_tenants=4)) == 10


def test_traces_are_written_only_to_a_file_path(tmp_path):
    trace = multi_tenant_trace(5, num_tenants=2)
    with pytest.raises(ValueError, match="is a folder: give a file path"):
        write_trace(trace, tmp_path)
    with pytest.raises(ValueError, match="No folder"):
        write_trace(trace, tmp_path / "missing" / "t.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        write_trace(trace, "/dev/null")
    assert len(read_trace(write_trace(trace, tmp_path / "t.jsonl"))) == 5


# --- reading within bounds ---------------------------------------------------------------------------

LINE = '{{"id": "r{}", "arrival": 0, "prompt_ids": [1, 2], "max_new_tokens": 2}}\n'


def good_lines(n: int, start: int = 0) -> str:
    return "".join(LINE.format(i) for i in range(start, start + n))


def refused(path, *, line: int, match: str, seconds: float = 30) -> str:
    """read_trace's TraceError, checked to name `path:line` with `match` after it."""
    with within(seconds), pytest.raises(TraceError) as e:
        read_trace(path)
    assert re.search(rf"{re.escape(str(path))}:{line}: .*{match}", str(e.value)), str(e.value)
    return str(e.value)


def test_gzip_data_cut_short_or_corrupt_is_named_with_file_and_line(tmp_path):
    whole = gzip.compress(good_lines(40_000).encode())    # 2.8 MB of text: several buffers
    cases = {"cut.jsonl.gz": (whole[:len(whole) // 2], "EOFError"), "magic.jsonl.gz": (b"\x1f\x8b", "EOFError"),
             "crc.jsonl.gz": (whole[:-8] + bytes(4) + whole[-4:], "CRC check failed"),
             "deflate.jsonl.gz": (whole[:12] + b"\xff" * 8 + whole[20:], "Error -3")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        message = refused(tmp_path / name, line=r"\d+", match=f"cannot read further .*{why}.*reading stopped here")
        assert message.startswith("1 bad line(s)"), message     # the lines read before it were whole
    line = int(re.search(r"cut.jsonl.gz:(\d+):", refused(tmp_path / "cut.jsonl.gz", line=r"\d+", match="")).group(1))
    assert 10_000 < line <= 20_001     # where the data ends, less at most a buffer read ahead


def test_json_nested_too_deeply_is_a_bad_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(good_lines(1) + "[" * 100_000 + "\n" + good_lines(1, 1))
    refused(path, line=2, match="nested too deeply")


def test_an_overlong_line_is_named_and_skipped(tmp_path):
    path = tmp_path / "long.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(good_lines(1).encode() + b"1" * (jsonlines.MAX_LINE_BYTES + 5) + b"\n{}\n" + good_lines(1, 1).encode())
    message = refused(path, line=2, match="longer than 16 MB")
    assert f"{path}:3: missing field 'id'" in message and "2 bad line(s)" in message   # reading went on after it


def test_the_text_limit_stops_reading(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    path.write_text(good_lines(100))                 # about 70 bytes a line
    monkeypatch.setattr(budget, "MAX_TRACE_TEXT_BYTES", 1000)
    refused(path, line=15, match="passes 1,000 bytes here .kvlearn reads at most")
    monkeypatch.setattr(budget, "MAX_TRACE_TEXT_BYTES", 10**9)
    monkeypatch.setattr(budget, "available_bytes", lambda: (32_000, None))   # 2,000 bytes of text, parsed
    refused(path, line=29, match="passes 2,000 bytes here .parsed, about 16 bytes a byte of text, it would not fit")


def test_blank_runs_are_counted_fast_and_a_blank_bomb_is_bounded(tmp_path, monkeypatch):
    path = tmp_path / "blank.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(good_lines(1).encode() + b"\n" * 30_000_000 + b"{}\n")
    refused(path, line=30_000_002, match="missing field 'id'", seconds=20)
    monkeypatch.setattr(budget, "MAX_TRACE_TEXT_BYTES", 2**20)
    refused(path, line=r"\d+", match="passes 1,048,576 bytes here", seconds=5)


def test_reading_stops_after_a_thousand_bad_lines(tmp_path):
    path = tmp_path / "junk.jsonl"
    path.write_text("x\n" * 5000)
    message = refused(path, line=1001, match="1,000 bad lines before this one: is this a trace. reading stopped here")
    assert f"{path}:20: not valid JSON" in message and f"{path}:21:" not in message and "... and 980 more" in message


def test_a_mooncake_block_size_beyond_any_context_is_refused(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n')
    with pytest.raises(ValueError, match="block_size must be at most 1,048,576"):
        read_trace(path, block_size=10**15)
    assert read_trace(path, block_size=2**20)[0].num_prompt_tokens == 10


# --- policies --------------------------------------------------------------------------------------

def test_round_robin_cycles():
    p = RoundRobin()
    assert [p.choose(req([1]), view(3)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_covers_replicas():
    p, q = RandomChoice(seed=5), RandomChoice(seed=5)
    assert [p.choose(req([1]), view(4)) for _ in range(50)] == [q.choose(req([1]), view(4)) for _ in range(50)]
    assert {p.choose(req([1]), view(4)) for _ in range(200)} == {0, 1, 2, 3}


def test_least_load_takes_the_lighter_of_two():
    p = LeastLoad(seed=0)
    load = [50, 10, 30, 0]
    for _ in range(200):
        i = p.choose(req([1]), view(4, outstanding=load))
        assert i != 0   # the heaviest replica always loses its pair
    assert LeastLoad().choose(req([1]), view(1)) == 0


def test_prefix_hash_is_sticky_on_the_prefix_and_spreads_prefixes():
    p = PrefixHash(8, prefix_tokens=4)
    a = p.choose(req([1, 2, 3, 4, 99]), view(8))
    assert p.choose(req([1, 2, 3, 4, 7, 7]), view(8)) == a
    rng = random.Random(0)
    spread = {p.choose(req([rng.randrange(1000) for _ in range(4)]), view(8)) for _ in range(400)}
    assert len(spread) == 8


def test_prefix_hash_moves_few_prefixes_when_a_replica_joins():
    rng = random.Random(1)
    prompts = [[rng.randrange(10**6) for _ in range(4)] for _ in range(2000)]
    before = [PrefixHash(8).choose(req(p), view(8)) for p in prompts]
    after = [PrefixHash(9).choose(req(p), view(9)) for p in prompts]
    moved = sum(b != a for b, a in zip(before, after, strict=True)) / len(prompts)
    assert moved < 0.25 and all(a == 8 for b, a in zip(before, after, strict=True) if b != a)   # only to the new one


def owner_of(prompt, n):
    """The ring's replica for `prompt` when nobody is busy."""
    return PrefixHash(n).choose(req(prompt), view(n))


def loads_with(owner, owner_load, others, n):
    return [owner_load if i == owner else others.pop(0) for i in range(n)]


def test_prefix_hash_load_bound_is_sglangs_rule():
    # SGLang's own example: 100 requests in flight on 4 workers, load_factor 1.25: the bound is
    # 1.25 x (100 + 1) / 4 = 31.56; a worker with 30 keeps the request, one with 35 loses it
    prompt = [5, 6, 7]
    owner = owner_of(prompt, 4)
    p = PrefixHash(4)
    kept = loads_with(owner, 30, [30, 30, 10], 4)
    assert p.choose(req(prompt), view(4, inflight=kept)) == owner
    moved = loads_with(owner, 35, [30, 30, 5], 4)
    assert p.choose(req(prompt), view(4, inflight=moved)) == moved.index(5)   # the least loaded
    assert p.decisions == {"ring": 1, "load_bound": 1}
    # the comparison is <=: a load exactly at the bound (1.0 x (2+2+2+1 + 1) / 4 = 2) stays
    assert PrefixHash(4, load_factor=1.0).choose(req(prompt),
                                                 view(4, inflight=loads_with(owner, 2, [2, 2, 1], 4))) == owner


def test_prefix_hash_bound_sends_a_request_away_from_an_overloaded_replica_unbounded_does_not():
    prompt = [1, 2, 3, 4]
    owner = owner_of(prompt, 8)
    busy = loads_with(owner, 12, [3, 2, 4, 1, 3, 2, 0], 8)      # 27 in flight: bound 1.25 x 28 / 8 = 4.4
    assert PrefixHash(8).choose(req(prompt), view(8, inflight=busy)) == busy.index(0)
    for unbounded in (None, float("inf")):
        assert PrefixHash(8, load_factor=unbounded).choose(req(prompt), view(8, inflight=busy)) == owner
    # ties among the replicas within the bound: fewer outstanding tokens, then the lowest index
    tied = loads_with(owner, 12, [1] * 7, 8)
    outstanding = [100] * 8
    far = (owner + 3) % 8
    outstanding[far] = 5
    assert PrefixHash(8).choose(req(prompt), view(8, inflight=tied, outstanding=outstanding)) == far
    # every replica over the bound (possible only with load_factor < 1): the owner keeps it
    assert PrefixHash(8, load_factor=0.5).choose(req(prompt), view(8, inflight=[4] * 8)) == owner


def test_prefix_hash_rejects_bad_load_factors():
    for bad in (0, -1.25, float("nan")):
        with pytest.raises(ValueError, match="load_factor must be > 0"):
            make_policy("prefix_hash", 4, load_factor=bad)


def test_page_hashes_name_whole_prefixes():
    a, b = router_page_hashes([1, 2, 3, 4, 5, 6, 7], 2), router_page_hashes([1, 2, 3, 4, 9, 9], 2)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert router_page_hashes([3, 4, 1, 2], 2)[1] != a[1]   # the same page after a different prefix differs


def test_approx_tree_evicts_leaves_first_and_reports_memory():
    tree = ApproxTree(max_pages=4)
    shared = router_page_hashes(list(range(6)), 2)            # 3 pages
    tree.insert(shared)
    tree.insert(router_page_hashes(list(range(4)) + [50, 51], 2))   # shares 2 pages, adds 1: 4 pages
    assert len(tree) == 4 and tree.match(shared) == 3
    tree.insert(router_page_hashes([9, 9, 8, 8], 2))          # 2 new pages: the 2 oldest leaves go
    assert len(tree) == 4 and tree.evicted_pages == 2
    assert tree.match(shared) == 2                     # the shared trunk stayed, its old leaf went
    assert tree.nbytes > 0


def test_approx_tree_binary_search_matches_like_a_scan_and_the_router_indexes_first_pages():
    rng = random.Random(0)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    p = CacheAware(3, tree_page_size=4, max_tree_pages=12)
    for k in range(300):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        hashes = router_page_hashes(prompt, 4)
        for tree in p.trees:   # the pages present are a head of the chain: a scan finds the same end
            scan = next((n for n, h in enumerate(hashes) if h not in tree.pages), len(hashes))
            assert tree.match(hashes) == scan
        p.routed(req(prompt, rid=f"r{k}"), rng.randrange(3))
        for first, holders in p.holders.items():   # exactly the trees that hold that first page
            assert holders == {i for i, tree in enumerate(p.trees) if first in tree.pages}


def test_cache_aware_hashes_a_shared_first_part_once_with_the_same_chain():
    p = CacheAware(2, tree_page_size=16)
    trace = multi_tenant_trace(300, num_tenants=4, seed=5)
    assert all(p.prompt_chain(r) == router_page_hashes(r.prompt_ids, 16) for r in trace)
    assert p.num_shared_heads == 4   # one per tenant's system prompt
    odd = TraceRequest("odd", 0.0, ((1, 2, 3), tuple(range(40))), 4)   # a first part shorter than a page
    assert p.prompt_chain(odd) == router_page_hashes(odd.prompt_ids, 16)


def test_cache_aware_follows_its_own_decisions():
    p = CacheAware(3, tree_page_size=2, balance_abs_threshold=100)
    system = list(range(100, 140))
    first = p.choose(req(system + [1, 2]), view(3, inflight=[0, 0, 0]))
    p.routed(req(system + [1, 2]), first)
    load = [1, 1, 1]
    load[first] = 2   # busier, but within the thresholds: affinity wins
    assert p.choose(req(system + [5, 6, 7]), view(3, inflight=load)) == first
    assert p.decisions["cache_hit"] == 1


def test_cache_aware_low_match_and_imbalance_go_to_the_least_loaded():
    p = CacheAware(3, tree_page_size=2, cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = list(range(20))
    p.routed(req(prompt), 0)
    assert p.choose(req(list(range(500, 520))), view(3, inflight=[3, 2, 1])) == 2        # no match
    assert p.choose(req(prompt), view(3, inflight=[10, 2, 1])) == 2                      # imbalanced
    assert p.choose(req(prompt), view(3, inflight=[5, 2, 1])) == 0                       # 5-1 = 4: not above abs
    assert p.decisions == {"imbalanced": 1, "cache_hit": 1, "low_match": 1}


def test_cache_aware_ties_go_to_the_less_loaded_holder():
    p = CacheAware(3, tree_page_size=2)
    prompt = list(range(10))
    p.routed(req(prompt), 0)
    p.routed(req(prompt), 2)
    assert p.choose(req(prompt), view(3, inflight=[2, 0, 1])) == 2


def test_cache_aware_trees_are_bounded():
    p = CacheAware(2, tree_page_size=4, max_tree_pages=10)
    rng = random.Random(0)
    for _ in range(50):
        r = req([rng.randrange(1000) for _ in range(40)])
        p.routed(r, p.choose(r, view(2)))
    stats = p.tree_stats()
    assert stats["tree_pages"] <= 20 and stats["tree_evicted_pages"] > 0 and stats["tree_bytes"] > 0


def test_exact_asks_the_replicas():
    p = Exact(3)
    assert p.choose(req(list(range(10))), view(3, cached=[2, 8, 8], inflight=[0, 3, 1])) == 2
    assert p.choose(req(list(range(10))), view(3, cached=[2, 2, 2], inflight=[0, 3, 1])) == 0   # 2/10 <= 0.3


def test_make_policy_names_and_errors():
    for name in POLICIES:
        assert make_policy(name, 4).name == name
    with pytest.raises(ValueError, match="Unknown policy 'fastest'.*round_robin"):
        make_policy("fastest", 4)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", 4, cache_threshold=2)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        make_policy("exact", 4, balance_rel_threshold=0.5)


# --- python -m kvlearn route --load-factor ----------------------------------------------------------

def test_route_load_factor_reaches_prefix_hash(capsys):
    def moved(*extra):
        assert route(["--generate", "120", "--tenants", "2", "--hot-tenant", "0.9", "--rate", "200", "--replicas", "4",
                      "--policy", "prefix_hash", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["decisions"]["load_bound"]
    assert moved() > 0 and moved("--load-factor", "1.25") == moved()
    assert moved("--load-factor", "inf") == 0


@pytest.mark.parametrize("value", ["0", "-2", "nan", "many"])
def test_route_rejects_bad_load_factors(value, capsys):
    with pytest.raises(SystemExit) as stop:
        route(["--generate", "10", "--policy", "prefix_hash", "--load-factor", value])
    assert stop.value.code == 2
    assert f"argument --load-factor: must be a number > 0 (inf: unbounded), got '{value}'" in capsys.readouterr().err
