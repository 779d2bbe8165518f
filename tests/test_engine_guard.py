"""Trust but verify: a learner's part (kvlearn.parts) serves behind thin checks at its boundary and
the engine's own invariants. The wrong parts here are the notebooks' worked solutions (chapters 3
and 4) or the package's own classes, each with one bug; each raises PartError at its first wrong
answer, naming the part, the call and the rule, and the engine stops: every later call says why."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from kvlearn import BlockManager, Engine, KVPool, PartError, RadixCache
from kvlearn.allocator import PageAllocator
from kvlearn.attention import paged_attention
from kvlearn.radix import MatchResult
from kvlearn.serving.cache_modes import BlockKV, RadixKV
from kvlearn.serving.part_registry import served

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
SLOTS = 512


def worked_solution(notebook: str, part: str, name: str) -> type:
    """The class a notebook's `%%part` cell defines (its worked solution)."""
    cells = nbformat.read(NOTEBOOKS / notebook, as_version=4).cells
    source = next(c.source for c in cells if c.cell_type == "code" and c.source.startswith(f"%%part {part}\n"))
    namespace: dict = {}
    exec(source.partition("\n")[2], namespace)
    return namespace[name]


MyRadixCache = worked_solution("03_radix_tree.ipynb", "radix_cache", "MyRadixCache")
MyAllocator = worked_solution("04_kv_pool.ipynb", "allocator", "MyAllocator")


class RepeatsSlotOnLongKeys(MyRadixCache):
    """Chapter 3's tree, but a match of a key over LONG tokens repeats its second-to-last slot."""

    LONG = 30

    def match_prefix(self, key):
        match = super().match_prefix(key)
        if len(key) > self.LONG and len(match) >= 2:
            indices = match.indices.clone()
            indices[-1] = indices[-2]
            return MatchResult(indices, match.last_node)
        return match


class HandsOutPagesTwice(MyAllocator):
    """Chapter 4's allocator, but from its 50th alloc on, the last page it hands out is the first
    page of the alloc before."""

    def __init__(self, num_pages, device=None):
        super().__init__(num_pages, device)
        self.allocs, self.previous = 0, None

    def alloc(self, n):
        pages = super().alloc(n)
        self.allocs += 1
        if self.allocs >= 50 and n and self.previous is not None and len(self.previous):
            pages = pages.clone()
            pages[-1] = self.previous[0]
        self.previous = pages
        return pages


class MatchesOneTokenMore(RadixCache):
    """The package's tree, but a match where the tree goes on takes one slot more than it matched."""

    def match_prefix(self, key):
        match = super().match_prefix(key)
        if match.last_node.children:
            child = next(iter(match.last_node.children.values()))
            return MatchResult(torch.cat([match.indices, child.value[:1]]), match.last_node)
        return match


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_stopped(engine):
    """The engine serves no more, and says why."""
    with pytest.raises(RuntimeError, match=r"this Engine stopped when a part broke its contract .* build a new Engine"):
        engine.generate([prompt(4, 9)], max_new_tokens=2)
    engine.close()   # asks the broken part nothing


def assert_whole(engine):
    """Nothing runs or waits, and every slot is free or held only by the cache (until evict_all)."""
    assert not engine.has_unfinished()
    assert engine.pool.num_free + engine.kv.evictable_slots == engine.pool.num_slots
    engine.evict_all()
    assert engine.pool.num_free == engine.pool.num_slots


def test_the_package_parts_serve_unguarded(model, tokenizer):
    engine = Engine(model, tokenizer, num_slots=SLOTS)
    assert type(engine.kv) is RadixKV and type(engine.pool.allocator) is PageAllocator
    assert engine.runner.attention is paged_attention
    ours = Engine(model, tokenizer, num_slots=SLOTS, cache="blocks",
                  parts={"block_manager": BlockManager, "allocator": PageAllocator, "attention": paged_attention})
    assert type(ours.kv) is BlockKV and type(ours.pool.allocator) is PageAllocator
    assert ours.runner.attention is paged_attention


def test_a_match_that_repeats_a_slot_is_refused_and_the_engine_serves_on(model, tokenizer):
    engine = Engine(model, tokenizer, num_slots=SLOTS, parts={"radix_cache": RepeatsSlotOnLongKeys})
    long = prompt(40, 0)
    with pytest.raises(PartError, match=r"parts\['radix_cache'\] \(RepeatsSlotOnLongKeys\) broke its contract in "
                                        r"\w+_prefix\(a key of 4\d tokens\).*appears twice, at positions 38 and 39"):
        engine.generate([long], max_new_tokens=4)
    assert_stopped(engine)


def test_an_allocator_that_hands_out_a_page_twice_is_refused(model, tokenizer):
    engine = Engine(model, tokenizer, num_slots=SLOTS, parts={"allocator": HandsOutPagesTwice})
    prompts = [prompt(6, seed) for seed in range(4)]
    with pytest.raises(PartError, match=r"parts\['allocator'\] \(HandsOutPagesTwice\) broke its contract in "
                                        r"alloc\(1\).*page \d+ is held \(handed out before and not freed since\)"):
        engine.generate(prompts, max_new_tokens=16)
    assert engine.pool.allocator.part.allocs == 50   # its first wrong answer
    assert_stopped(engine)


def test_a_match_longer_than_its_key_is_refused(model, tokenizer):
    engine = Engine(model, tokenizer, num_slots=SLOTS, parts={"radix_cache": MatchesOneTokenMore})
    first = prompt(16, 3)
    engine.generate([first], max_new_tokens=4)
    with pytest.raises(PartError, match=r"\(MatchesOneTokenMore\) broke its contract in match_prefix\(a key of 9 "
                                        r"tokens\): it returned .*\(10 items\) for a key of 9 tokens, but a match is "
                                        r"never longer than its key"):
        engine.generate([first[:10]], max_new_tokens=4)
    assert_stopped(engine)


class GivesAHeldBlock(BlockManager):
    """The package's block manager, but a sequence's last new block is the first block of the
    sequence allocated before it (still live)."""

    def allocate(self, seq):
        super().allocate(seq)
        if getattr(self, "last", None) is not None and self.last.block_table:
            seq.block_table[-1] = self.last.block_table[0]
        self.last = seq


def test_a_block_table_holding_another_sequence_block_is_refused(model, tokenizer):
    engine = Engine(model, tokenizer, cache="blocks", num_slots=SLOTS, parts={"block_manager": GivesAHeldBlock})
    with pytest.raises(PartError, match=r"parts\['block_manager'\] \(GivesAHeldBlock\) broke its contract in "
                                        r"allocate.*block \d+ is in another live table"):
        engine.generate([prompt(20, 4), prompt(20, 5)], max_new_tokens=4)
    assert_stopped(engine)


@pytest.mark.parametrize("bad, why", [(lambda out: out[:-1], r"returns \[T, heads, head_dim\] = \[\d+, 9, 64\]"),
                                      (lambda out: out.double(), "of torch.float32"),
                                      (lambda out: out * float("nan"), "NaN in its output")])
def test_an_attention_output_of_the_wrong_shape_dtype_or_with_nan_is_refused(model, tokenizer, bad, why):
    def my_attention(*args):
        return bad(paged_attention(*args))

    engine = Engine(model, tokenizer, num_slots=SLOTS, parts={"attention": my_attention})
    with pytest.raises(PartError, match=r"parts\['attention'\] \(.*my_attention\) broke its contract in "
                                        rf"attention\(layer 0, 6 tokens\).*{why}"):
        engine.generate([prompt(6, 6)], max_new_tokens=2)
    assert_stopped(engine)


# --- slot conservation: a real check (python -O keeps it) that names whose bookkeeping broke ---------

CONSERVATION = """
import sys
from kvlearn import KVPool, PartError
from kvlearn.serving.cache_modes import make_kv_manager
sys.path.insert(0, {tests!r})
from test_engine_guard import MyAllocator

kv = make_kv_manager("radix", KVPool(1, 1, 1, 64))
kv.pool.alloc(1)   # a slot taken behind the bookkeeping's back
try:
    kv.check([])
except RuntimeError as err:
    print(type(err).__name__, err)
kv = make_kv_manager("radix", KVPool(1, 1, 1, 64, allocator_cls=MyAllocator))
kv.pool.alloc(1)
try:
    kv.check([])
except PartError as err:
    print(type(err).__name__, err)
"""


@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
def test_slot_conservation_is_checked_under_python_O_and_names_the_parts():
    out = subprocess.run([sys.executable, "-O", "-c", CONSERVATION.format(tests=str(Path(__file__).parent))],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent).stdout
    package, learner = out.strip().splitlines()
    assert package.startswith("RuntimeError slot leak: 63 free + 0 evictable + 0 in use != 64: the package's own "
                              "bookkeeping broke (no learner's part serves here)")
    assert learner.startswith("PartError parts['allocator'] (MyAllocator) broke its contract in the step's slot "
                              "bookkeeping: it returned slot leak: 63 free")


def test_a_guarded_pool_refuses_a_double_free_by_its_own_account():
    pool = KVPool(1, 1, 1, 8, allocator_cls=served({"allocator": MyAllocator}, "allocator"))
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(ValueError, match=r"Double free: page\(s\) \[\d+\] are free by the pool's account"):
        pool.free(slots[:1])
    assert pool.num_free == 8 and pool.allocator.part.num_free == 8


def test_a_standalone_pool_builds_the_allocator_it_is_given_and_only_the_engine_guards_it():
    assert type(KVPool(1, 1, 1, 8, allocator_cls=MyAllocator).allocator) is MyAllocator
    guarded = served({"allocator": MyAllocator}, "allocator")
    assert type(KVPool(1, 1, 1, 8, allocator_cls=guarded).allocator.part) is MyAllocator
    assert served({"allocator": PageAllocator}, "allocator") is None and served({}, "allocator") is None


def test_the_guarded_kv_managers_show_the_learner_part_as_their_cache():
    pool = KVPool(1, 1, 1, 64, page_size=4, allocator_cls=served({"allocator": MyAllocator}, "allocator"))
    kv = served({"radix_cache": MyRadixCache}, "radix_cache")(pool, 256)
    assert type(kv.cache) is MyRadixCache and type(pool.allocator.part) is MyAllocator
    assert [name for name, _ in kv.foreign_parts()] == ["allocator", "radix_cache"]


def test_a_learner_part_without_a_registered_guard_is_refused():
    """Chapter 6 serves a learner's part only behind a guard: a name no table of guards covers is
    refused, not served bare (the block table is checked and drawn, never served)."""
    with pytest.raises(ValueError, match=r"parts\['block_table'\] has no guard registered .* a learner's part "
                                         "serves only behind one"):
        served({"block_table": GivesAHeldBlock}, "block_table")


@pytest.mark.parametrize("cache, part", [("radix", "radix_cache"), ("blocks", "block_manager")])
def test_right_parts_pass_the_guard_under_memory_pressure(model, tokenizer, cache, part):
    """Evictions and preemptions through the guards: no false alarm, the package's tokens."""
    from tests.test_parts import MINE

    prompts = [prompt(12, 7)[:8] + prompt(6, seed) for seed in range(6)]
    options = dict(cache=cache, num_slots=64, max_batch_tokens=32)
    theirs = Engine(model, tokenizer, **options)
    ours = Engine(model, tokenizer, **options, parts={part: MINE[part], "allocator": MyAllocator})
    expected_tokens = [o.token_ids for o in theirs.generate(prompts, max_new_tokens=12)]
    assert [o.token_ids for o in ours.generate(prompts, max_new_tokens=12)] == expected_tokens
    assert ours.stats["evicted_tokens"] > 0 and ours.stats["preemptions"] == theirs.stats["preemptions"]
    assert_whole(ours)
