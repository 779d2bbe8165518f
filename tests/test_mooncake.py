"""Chapter 7 on real traffic: the Mooncake trace reader, the bundled traces, and `replay`."""

import gzip
import json
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlearn.radix import RadixCache
from kvlearn.routing.cli import main as route
from kvlearn.routing.mooncake import MooncakeRequest, MooncakeTrace, is_mooncake, mooncake_trace_path, read_mooncake
from kvlearn.routing.policies import POLICIES
from kvlearn.routing.replay import PAPER_CACHE_RATIO, figure9, replay, tail_bound
from kvlearn.routing.replay import main as replay_cli
from kvlearn.routing.trace_request import TraceError
from kvlearn.routing.traces import read_trace


def write(path: Path, rows, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return path


def row(t, n, ids, out=5):
    return {"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids}


# --- the reader ------------------------------------------------------------------------------------

def test_every_bad_line_is_reported_with_its_number(tmp_path):
    rows = [row(0, 8, [1, 2]),
            "{not json",                                         # 2
            {"timestamp": 0, "input_length": 8, "hash_ids": [1, 2]},   # 3: no output_length
            row(-1, 8, [1, 2]),                                  # 4: negative timestamp
            row(0, 9, [1, 2]),                                   # 5: 9 tokens need 3 blocks of 4
            row(0, 8, [1, True]),                                # 6: a bool is no id
            row(0, 8, [3, 2]),                                   # 7: 2 follows 1 on line 1
            "",
            row(0, 8, [7, 7]),                                   # 9: 7 cannot follow itself
            row(5, 4, [1])]
    path = write(tmp_path / "t.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["\xff"]}\n')  # 11: not UTF-8
    with pytest.raises(TraceError) as e:
        read_mooncake(path, block_size=4)
    message = str(e.value)
    assert message.startswith("8 bad line(s)")
    for number, words in ((2, "not valid JSON"), (3, "'output_length'"), (4, "'timestamp'"), (5, "needs 3 block(s)"),
                          (6, "True"), (7, "follows 3 here but 1 on line 1"), (9, "earlier on this line"),
                          (11, "not UTF-8")):
        assert any(line.strip().startswith(f"{path}:{number}: ") and words in line
                   for line in message.splitlines()), number
    assert f"{path}:1:" not in message and f"{path}:10:" not in message


def test_gzipped_plain_and_hex_ids_read_the_same(tmp_path):
    ints = [row(2000, 10, [5, 6, 7]), row(0, 8, [5, 6]), row(1000, 5, [5, 9])]
    hexes = [dict(r, hash_ids=[f"{h:016x}" for h in r["hash_ids"]]) for r in ints]
    plain = read_mooncake(write(tmp_path / "a.jsonl", ints), block_size=4)
    zipped = read_mooncake(write(tmp_path / "b.data", ints, gz=True), block_size=4)   # gzip known by its bytes
    hexed = read_mooncake(write(tmp_path / "c.jsonl.gz", hexes, gz=True), block_size=4)
    for trace in (plain, zipped, hexed):
        assert [(r.line, r.arrival, r.input_length, r.blocks) for r in trace.requests] == [
            (2, 0.0, 8, (0, 1)), (3, 1.0, 5, (0, 3)), (1, 2.0, 10, (0, 1, 2))]   # sorted; ids dense by first use
        assert trace.num_blocks == 4 and trace.prompt_tokens == 23


def test_pages_carry_exactly_the_trace_prefix_sharing(tmp_path):
    path = write(tmp_path / "t.jsonl", [row(0, 8, [5, 6]), row(1500, 10, [5, 6, 7], out=0), row(1600, 6, [5, 9])])
    assert is_mooncake(path) and not is_mooncake(write(tmp_path / "course.jsonl", [
        {"id": "a", "arrival": 0, "prompt_ids": [1, 2], "max_new_tokens": 2}]))
    a, b, c = read_trace(path, block_size=4)
    assert [r.num_prompt_tokens for r in (a, b, c)] == [8, 10, 6]
    assert (b.arrival, b.max_new_tokens, a.max_new_tokens) == (1.5, 1, 5)   # ms -> s; at least one token out
    assert b.prompt_ids[:8] == a.prompt_ids and c.prompt_ids[:4] == a.prompt_ids[:4]
    assert c.prompt_ids[4] != a.prompt_ids[4]
    # each block opens with a token id of its own (4 distinct ids), the rest is one shared filler
    assert [p[::4] for p in (a.prompt_ids, b.prompt_ids, c.prompt_ids)] == [[4, 5], [4, 5, 6], [4, 7]]
    assert {t for p in (a, b, c) for k, t in enumerate(p.prompt_ids) if k % 4} == {3}
    assert a.parts[1] is b.parts[1] is c.parts[1]   # the filler is one tuple, shared by every block


def test_bundled_traces_have_the_papers_statistics():
    for name, (n, avg_in, avg_out) in {"conversation": (12031, 12035, 343), "synthetic": (3993, 15325, 149)}.items():
        trace = read_mooncake(mooncake_trace_path(name))
        assert len(trace) == n
        assert round(trace.prompt_tokens / n) == avg_in
        assert round(sum(r.output_length for r in trace.requests) / n) == avg_out
    assert trace.requests[0].arrival <= trace.requests[-1].arrival
    with pytest.raises(ValueError, match="bundled: conversation, synthetic"):
        mooncake_trace_path("toolagent")


# --- replay: by hand -------------------------------------------------------------------------------

HAND = [row(0, 8, [1, 2]), row(2000, 8, [1, 4]), row(1000, 10, [1, 2, 3]), row(3000, 12, [1, 2, 5]),
        row(4000, 10, [1, 2, 3])]


@pytest.mark.parametrize("capacity, page, cached, evicted", [
    # unbounded: r2 reuses r1's 8 tokens, r3 block 1, r4 blocks 1-2, r5 blocks 1-2; the partial
    # third block of r2 and r5 (2 tokens of id 3) is never cached with pages of 4
    (None, 4, 0 + 8 + 4 + 8 + 8, 0),
    # ... but pages of 2 cache it: r5 reuses 10 tokens
    (None, 2, 0 + 8 + 4 + 8 + 10, 0),
    # 3 pages: r4 adds page 5 to 1-2 (and 4): page 4, the least recently used leaf, goes
    (12, 4, 0 + 8 + 4 + 8 + 8, 4),
    # 2 pages (8 or 9 tokens): r3 splits [1,2] and evicts 2; r4 inserts [2,5] as one node, evicts
    # 4 (its own path locked), is still over, so then its own leaf [2,5] goes whole; r5 finds [1]
    (8, 4, 0 + 8 + 4 + 4 + 4, 4 + 4 + 8),
    (9, 4, 0 + 8 + 4 + 4 + 4, 4 + 4 + 8),
    # 1 page: each prompt's path is one node of 2 or 3 pages, evicted whole after its request
    (4, 4, 0, 8 + 8 + 8 + 12 + 8),
])
def test_hand_made_trace(tmp_path, capacity, page, cached, evicted):
    trace = read_mooncake(write(tmp_path / "hand.jsonl", HAND), block_size=4)
    result = replay(trace, capacity, page)
    assert (result.requests, result.prompt_tokens) == (5, 48)
    assert (result.cached_tokens, result.evicted_tokens) == (cached, evicted)
    assert result.hit_rate == cached / 48


def test_lfu_keeps_the_requests_own_path(tmp_path):
    """2 pages, LFU. r3 splits [1,2] (both halves keep r2's hit) and adds leaf [4] with no hit:
    the fewest hits, but on r3's own path, so [2] goes instead; r4 then matches [1] only. Were
    the path not locked, [4] would go and r4 would match [1,2]."""
    trace = read_mooncake(write(tmp_path / "hand.jsonl", HAND), block_size=4)
    result = replay(trace, 8, eviction_policy="lfu")
    assert (result.policy, result.cached_tokens, result.evicted_tokens) == ("lfu", 0 + 8 + 4 + 4 + 4, 4 + 4 + 8)


def test_replay_command_prints_one_json_object_per_capacity(tmp_path, capsys):
    path = write(tmp_path / "hand.jsonl.gz", HAND, gz=True)
    assert replay_cli(["--trace", str(path), "--block-size", "4", "--capacity-tokens", "4", "1.2e1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["capacity_tokens"], r["cached_tokens"], r["hit_rate"])
            for r in rows] == [(4, 0, 0.0), (12, 28, 0.583333)]
    assert replay_cli(["--trace", str(path), "--block-size", "4", "--policy", "lfu"]) == 0
    assert "hit rate" in capsys.readouterr().out
    assert replay_cli(["--trace", str(path)]) == 2   # blocks of 512: 10 tokens need 1 hash id, not 3
    assert "needs 1 block(s) of 512 tokens" in capsys.readouterr().err
    assert replay_cli(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "No trace file" in capsys.readouterr().err


# --- replay against references ---------------------------------------------------------------------

def reference_lru(trace: MooncakeTrace, capacity_tokens):
    """A radix tree's LRU without a tree, page = block: `cached` maps each cached prefix of block
    ids to its last access; `ends` holds the prefixes where a tree node ends (where a match or an
    insert ended). A node is the run of pages since the previous end on its path; whole unlocked
    leaf nodes go, least recently used first (two leaves never share a time: one call touches one
    path). Returns (cached tokens, evicted tokens)."""
    size = trace.block_size
    limit = float("inf") if capacity_tokens is None else capacity_tokens // size
    cached, ends, clock, hits, evicted = {}, set(), 0, 0, 0

    def evict_one(locked) -> int:
        leaves = [e for e in ends if not any(p[:-1] == e for p in cached) and locked[:len(e)] != e]
        if not leaves:
            return 0
        times = sorted(cached[e] for e in leaves)
        assert len(times) < 2 or times[0] < times[1]
        end = min(leaves, key=cached.get)
        start = max((k for k in range(len(end)) if end[:k] in ends), default=0)
        for k in range(start + 1, len(end) + 1):
            del cached[end[:k]]
        ends.discard(end)
        return len(end) - start

    for r in trace.requests:
        key = r.blocks[:r.input_length // size]
        clock += 1
        j = 0
        while j < len(key) and key[:j + 1] in cached:
            j += 1
        hits += j
        clock += 1                              # match, then insert: each call ticks once
        for k in range(1, len(key) + 1):
            cached[key[:k]] = clock
        ends.update(e for e in (key[:j], key) if e)
        for locked in (key, ()):               # first with the request's path locked, then without
            while len(cached) > limit and (pages := evict_one(locked)):
                evicted += pages
    return hits * size, evicted * size


@st.composite
def random_traces(draw):
    """Prompts as walks over a few symbols; a block's id names its whole prefix."""
    size = draw(st.sampled_from([1, 2, 4]))
    walks = draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=25))
    ids, requests = {}, []
    for line, walk in enumerate(walks, 1):
        blocks = tuple(ids.setdefault(tuple(walk[:k + 1]), len(ids)) for k in range(len(walk)))
        length = (len(walk) - 1) * size + draw(st.integers(1, size))
        requests.append(MooncakeRequest(line, float(line), length, 1, blocks))
    return MooncakeTrace(Path("random"), size, requests, len(ids))


def token_replay(trace: MooncakeTrace, capacity_tokens, page_size):
    """The replay at the token level: real prompts (pages of block_size token ids), pages of
    page_size tokens, one key per token."""
    cache = RadixCache(page_size=page_size)
    limit = float("inf") if capacity_tokens is None else capacity_tokens // page_size * page_size
    cached = evicted = 0
    for req in trace.trace_requests():
        key = req.prompt_ids
        cached += len(cache.match_prefix(key))
        _, path = cache.insert_prefix(key, torch.zeros(len(key), dtype=torch.int64))
        if cache.total_size > limit:
            cache.lock(path.last_node)
            evicted += cache.evict(cache.total_size - limit)
            cache.unlock(path.last_node)
            if cache.total_size > limit:
                evicted += cache.evict(cache.total_size - limit)
    return cached, evicted


@given(random_traces(), st.sampled_from([None, 0, 1, 3, 5, 8, 13]))
def test_replay_matches_a_brute_force_lru(trace, capacity_pages):
    capacity = None if capacity_pages is None else capacity_pages * trace.block_size
    result = replay(trace, capacity)
    assert (result.cached_tokens, result.evicted_tokens) == reference_lru(trace, capacity)


@given(random_traces(), st.sampled_from([None, 0, 2, 5, 9, 16]), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_unit_keys_replay_equals_the_token_level_replay(trace, capacity, page_size):
    result = replay(trace, capacity, page_size)
    assert (result.cached_tokens, result.evicted_tokens) == token_replay(trace, capacity, page_size)


# --- route on real traffic -------------------------------------------------------------------------

def route_json(capsys, *args) -> list[dict]:
    assert route([*args, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_route_pages_default_to_the_traces_block_size(tmp_path, capsys):
    path = str(write(tmp_path / "hand.jsonl", HAND))
    fleet = ["--trace", path, "--block-size", "4", "--replicas", "2", "--policy", "all"]
    # no --page-size: a page is a block, the 30 slots become 7 whole pages of 4
    rows = route_json(capsys, *fleet, "--slots-per-replica", "30")
    assert {(r["page_size"], r["page_size_from"], r["slots_per_replica"]) for r in rows} == {
        (4, "the trace's block size", 28)}
    # ... which is the run an explicit --page-size 4 on 28 slots makes, that flag named instead
    explicit = route_json(capsys, *fleet, "--slots-per-replica", "28", "--page-size", "4")
    assert {r["page_size_from"] for r in explicit} == {"--page-size"}
    assert [{**r, "page_size_from": None, "sim_wall_s": None, "sim_requests_per_s": None} for r in rows] == \
        [{**r, "page_size_from": None, "sim_wall_s": None, "sim_requests_per_s": None} for r in explicit]
    # an explicit page size wins, and a slot count that is not whole pages is its user's to fix
    (smaller,) = route_json(capsys, *fleet[:-2], "--slots-per-replica", "30", "--page-size", "2")
    assert (smaller["page_size"], smaller["page_size_from"], smaller["slots_per_replica"]) == (2, "--page-size", 30)
    assert route([*fleet, "--slots-per-replica", "30", "--page-size", "4"]) == 2
    assert "must be a multiple of page_size" in capsys.readouterr().err
    # the table says it too, and a fleet without a single page is refused
    assert route([*fleet[:-2], "--slots-per-replica", "30"]) == 0
    assert "pages of 4: the trace's block size, 30 rounded down to whole pages" in capsys.readouterr().out
    assert route([*fleet, "--slots-per-replica", "3"]) == 2
    assert "holds no page of 4 tokens (the trace's block size)" in capsys.readouterr().err


@pytest.mark.thorough   # 7M prompt tokens through the fleet simulator (25 s of CPU); the tests above route small traces
def test_route_runs_a_slice_of_the_conversation_trace(tmp_path, capsys):
    with gzip.open(mooncake_trace_path("conversation"), "rt") as f:
        head = [next(f) for _ in range(500)]
    path = tmp_path / "slice.jsonl"
    path.write_text("".join(head))
    start = time.perf_counter()
    assert route(["--trace", str(path), "--replicas", "1", "--policy", "round_robin", "--page-size", "512",
                  "--slots-per-replica", str(512 * 800), "--max-batch-tokens", "65536", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    prompt_tokens = sum(json.loads(line)["input_length"] for line in head)
    assert (result["requests"], result["prompt_tokens"]) == (500, prompt_tokens)
    unbounded = replay(read_mooncake(path), None)
    assert 0 < result["hit_rate"] <= unbounded.hit_rate + 1e-9   # a bounded pool with outputs in it hits less
    assert time.perf_counter() - start < 120


@pytest.mark.thorough   # seven fleets of ten replicas on 7M prompt tokens: about 20 s of CPU
def test_route_pooled_beats_every_local_policy_on_a_slice(tmp_path, capsys):
    with gzip.open(mooncake_trace_path("conversation"), "rt") as f:
        head = [next(f) for _ in range(500)]
    path = tmp_path / "slice.jsonl"
    path.write_text("".join(head))
    pages = 300   # 153,600 tokens a replica: the slice's longest request fits, and the caches evict
    assert route(["--trace", str(path), "--replicas", "10", "--slots-per-replica", str(512 * pages), "--page-size",
                  "512", "--max-batch-tokens", "16384", "--speedup", "20", "--policy", "all",
                  "--pool-tokens", str(10 * 512 * pages), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    local, (pooled,) = rows[:-1], rows[-1:]
    assert [r["policy"] for r in local] == list(POLICIES) and all(r["pool_tokens"] == 0 for r in local)
    assert (pooled["policy"], pooled["pool_tokens"]) == ("least_load", 10 * 512 * pages)
    assert {r["requests"] for r in rows} == {500} and {r["prompt_tokens"] for r in rows} == {rows[0]["prompt_tokens"]}
    assert pooled["hit_rate"] >= max(r["hit_rate"] for r in local)
    assert 0 < pooled["loaded_tokens"] <= pooled["cached_tokens"] and not any(r["loaded_tokens"] for r in local)
    assert all(r["computed_prefill_tokens"] >= r["unique_token_floor"] for r in rows)


def block_lru(trace: MooncakeTrace, capacity_tokens: int) -> float:
    """An LRU of blocks, no tree: a prompt hits its longest run of cached leading blocks, then
    touches its blocks last to first, so a prefix is always more recent than its extensions."""
    size, lru, cached = trace.block_size, OrderedDict(), 0
    for r in trace.requests:
        full = r.blocks[:r.input_length // size]
        k = 0
        while k < len(full) and full[k] in lru:
            k += 1
        cached += k * size
        for b in reversed(full):
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > capacity_tokens // size:
            lru.popitem(last=False)
    return cached / trace.prompt_tokens


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_replay_agrees_with_a_block_lru_on_the_conversation_trace():
    trace = read_mooncake(mooncake_trace_path("conversation"))
    for capacity in (1_000_000, 3_000_000, 10_000_000):
        assert abs(replay(trace, capacity).hit_rate - block_lru(trace, capacity)) < 0.01


# --- Figure 9 --------------------------------------------------------------------------------------

def test_figure9_numbers_and_picture():
    import matplotlib
    matplotlib.use("Agg")
    from kvlearn.viz.capacity import plot_hit_rate_curves

    (at_3m, at_50m, unbounded), = figure9(("synthetic",), (3_000_000, 50_000_000)).values()
    assert unbounded.capacity_tokens is None
    # the numbers figure9's docstring quotes, and the paper's findings: 3M < half the maximum, 50M ~ all
    assert (round(at_3m.hit_rate, 3), round(at_50m.hit_rate, 3), round(unbounded.hit_rate, 3)) == (0.32, 0.65, 0.65)
    assert at_3m.hit_rate < unbounded.hit_rate / 2 and at_50m.hit_rate > 0.99 * unbounded.hit_rate
    assert unbounded.hit_rate < PAPER_CACHE_RATIO["synthetic"] < tail_bound(
        read_mooncake(mooncake_trace_path("synthetic")))
    fig = plot_hit_rate_curves({"synthetic": [at_3m, at_50m, unbounded]}, PAPER_CACHE_RATIO, 3_000_000)
    (ax,) = fig.axes
    assert "49% of max" in [t.get_text() for t in ax.texts]
    assert "synthetic: paper (Table 2), 66%" in [t.get_text() for t in ax.get_legend().get_texts()]


# --- Figure 10 --------------------------------------------------------------------------------------

def test_figure10_committed_runs_and_picture():
    import matplotlib
    matplotlib.use("Agg")
    from kvlearn.routing.replay import PAPER_POOLED_GAIN, figure10_results
    from kvlearn.viz.capacity import plot_pooled_vs_local

    fig10 = figure10_results()
    assert "--pool-tokens 29998080" in fig10["command"] and "{trace}" in fig10["command"]
    for name, n in (("conversation", 12031), ("synthetic", 3993)):
        rows = fig10["runs"][name]
        local, pooled = [r for r in rows if not r["pool_tokens"]], [r for r in rows if r["pool_tokens"]]
        assert [r["policy"] for r in local] == list(POLICIES) and len(pooled) == 1
        assert {r["requests"] for r in rows} == {n} and {r["replicas"] for r in rows} == {10}
        # the direction of the paper's Figure 10: the pool beats every local policy
        assert pooled[0]["hit_rate"] >= max(r["hit_rate"] for r in local)
        assert all(r["computed_prefill_tokens"] >= r["unique_token_floor"] for r in rows)
    fig = plot_pooled_vs_local(fig10["runs"], PAPER_POOLED_GAIN, {"conversation": 0.366})
    left, right = fig.axes
    assert [t.get_text() for t in left.get_xticklabels()][-1] == "least_load\n+ pool"
    assert "paper: pooled 2.22x local" in left.get_title() and left.get_legend() and not right.get_legend()
    assert any("x the best local" in t.get_text() for t in left.texts)
