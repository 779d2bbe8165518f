"""The known holes in the referees of chapters 1, 2 and 4 (issues 29 and 40), closed: each wrong part
is the worked solution of its notebook with one rule broken, and `check` must fail it with a hint whose
first line names that rule in the chapter's words. Also: the package's own `PageAllocator` refuses
what chapter 4's contract refuses (`free` of a bad page, `alloc` of a negative count), and leaves
the allocator as it was.
"""

import pytest
import torch

from kvlearn.allocator import PageAllocator
from kvlearn.errors import KVCapacityError
from kvlearn.parts import check
from tests.test_build_exercises import new_blocks_first, run_parts


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The instructor notebooks' worked parts, run as the notebooks run them (chapter 2 grows from
    chapter 1's saved part): part name -> class."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("course"))
        return dict(run_parts("instructor"))


def first_hint_line(report) -> str:
    assert not report.passed, report.message
    return report.message.split("\nHint: ", 1)[1].splitlines()[0]


# --- chapter 4: the allocator --------------------------------------------------------------------

def no_flip(base):
    class NoFlip(base):   # pushes pages as given: pages[-1] on top, handed out first
        def free(self, pages):
            pages = pages.to(self.device)
            if ((pages < 0) | (pages >= self.num_pages)).any() or self.free_flag[pages].any() \
                    or pages.unique().numel() != pages.numel():
                raise ValueError("refused")
            self.stack[self.top:self.top + len(pages)] = pages
            self.top += len(pages)
            self.free_flag[pages] = True
    return NoFlip


def repeats_accepted(base):
    class RepeatsAccepted(base):   # checks the flags only: [1, 1] would push page 1 twice
        def free(self, pages):
            pages = pages.to(self.device)
            if ((pages < 0) | (pages >= self.num_pages)).any() or self.free_flag[pages].any():
                raise ValueError("refused")
            self.stack[self.top:self.top + len(pages)] = pages.flip(0)
            self.top += len(pages)
            self.free_flag[pages] = True
    return RepeatsAccepted


def range_unchecked(base):
    class RangeUnchecked(base):   # -1 reads the last page's flag, num_pages raises IndexError
        def free(self, pages):
            pages = pages.to(self.device)
            if self.free_flag[pages].any() or pages.unique().numel() != pages.numel():
                raise ValueError("refused")
            self.stack[self.top:self.top + len(pages)] = pages.flip(0)
            self.top += len(pages)
            self.free_flag[pages] = True
    return RangeUnchecked


def negative_taken(base):
    class NegativeTaken(base):   # no n >= 0 check: alloc(-1) moves the top up, a page nobody freed counts free
        def alloc(self, n):
            if n > self.top:
                raise KVCapacityError("too many")
            pages = self.stack[self.top - n:self.top].flip(0)
            self.top -= n
            self.free_flag[pages] = False
            return pages
    return NegativeTaken


def negative_as_zero(base):
    class NegativeAsZero(base):   # alloc(-1) hands out nothing instead of refusing
        def alloc(self, n):
            return super().alloc(max(n, 0))
    return NegativeAsZero


# --- chapter 1: block tables ---------------------------------------------------------------------

def frees_one_by_one(base):
    class FreesOneByOne(base):   # one free() per block: they come back in reverse table order
        def deallocate(self, seq):
            self.check_live(seq)
            for block in [self.blocks[b] for b in seq.block_table]:
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.allocator.free(torch.tensor([block.block_id]))
            seq.block_table.clear()
            self.live_seqs.discard(seq.seq_id)
    return FreesOneByOne


def slots_of_the_dead(base):
    class SlotsOfTheDead(base):   # no check_live: a deallocated sequence gets an answer
        def slot_mapping(self, seq, start, end, device=None):
            size = self.block_size
            return torch.tensor([seq.block_table[p // size] * size + p % size for p in range(start, end)],
                                dtype=torch.int64, device=device)
    return SlotsOfTheDead


def deallocate_leaving(base, cached_tokens: int | None):
    """The worked deallocate, then `seq.num_cached_tokens` set to `cached_tokens` (None: as allocate left it)."""
    class LeavesCachedTokens(base):
        def deallocate(self, seq):
            before = seq.num_cached_tokens
            super().deallocate(seq)
            seq.num_cached_tokens = before if cached_tokens is None else cached_tokens
    return LeavesCachedTokens


def leaves_one_cached_token(base):
    return deallocate_leaving(base, 1)


def keeps_cached_tokens(base):
    return deallocate_leaving(base, None)


# --- chapter 2: the block manager ----------------------------------------------------------------

def deallocate_walking(base, forward: bool, table_order: bool):
    """The worked deallocate, walking the table forward or from its end, freeing what it does not
    cache in table order or in walk order."""
    class Deallocate(base):
        def deallocate(self, seq):
            self.check_live(seq)
            walk = seq.block_table if forward else seq.block_table[::-1]
            released = []
            for block in [self.blocks[b] for b in walk]:
                block.ref_count -= 1
                if block.ref_count > 0:
                    continue
                if self.hash_to_block_id.get(block.hash) == block.block_id:
                    self.cached_blocks[block.block_id] = None
                else:
                    self.forget(block)
                    released.append(block.block_id)
            if table_order and not forward:
                released.reverse()
            self.allocator.free(torch.tensor(released, dtype=torch.int64))
            seq.block_table.clear()
            seq.num_cached_tokens = 0
            self.live_seqs.discard(seq.seq_id)
    return Deallocate


def frees_in_walk_order(base):
    return deallocate_walking(base, forward=False, table_order=False)


def walks_forward(base):
    return deallocate_walking(base, forward=True, table_order=True)


def counts_nothing(base):
    class CountsNothing(base):   # stats stay at zero
        def count_hits(self, seq):
            pass
    return CountsNothing


def last_copy_wins(base):
    class LastCopyWins(base):   # hash_to_block_id[h] = b: a later copy replaces the published one
        def hash_blocks(self, seq, num_computed_tokens=None):
            self.check_live(seq)
            n = seq.num_tokens if num_computed_tokens is None else num_computed_tokens
            h, new = None, 0
            for i in range(n // self.block_size):
                block = self.blocks[seq.block_table[i]]
                if block.hash is None:
                    block.hash, block.token_ids = self.hash_fn(h, seq.block(i)), seq.block(i)
                    self.hash_to_block_id[block.hash] = block.block_id
                    new += 1
                h = block.hash
            return new
    return LastCopyWins


def publishes_at_allocate(base):
    class PublishesAtAllocate(base):   # before the KV is computed
        def allocate(self, seq):
            super().allocate(seq)
            self.hash_blocks(seq)
    return PublishesAtAllocate


WRONG = [
    ("allocator", no_flip, "free(pages) puts the pages back on top of the stack, pages[0] on top"),
    ("allocator", repeats_accepted, "free refuses a page listed twice in one call"),
    ("allocator", range_unchecked, "free refuses a page outside 0 .. num_pages - 1"),
    ("allocator", negative_taken, "alloc(n) refuses a negative n (ValueError) and changes nothing"),
    ("allocator", negative_as_zero, "alloc(n) refuses a negative n (ValueError) and changes nothing"),
    ("block_table", leaves_one_cached_token, "deallocate sets seq.num_cached_tokens back to 0"),
    ("block_manager", leaves_one_cached_token, "deallocate sets seq.num_cached_tokens back to 0"),
    ("block_manager", keeps_cached_tokens, "deallocate sets seq.num_cached_tokens back to 0"),
    ("block_table", frees_one_by_one, "deallocate gives the blocks nobody holds back to the free list in table order"),
    ("block_table", slots_of_the_dead, "deallocate, may_append, can_append and slot_mapping raise ValueError"),
    ("block_manager", frees_in_walk_order, "deallocate walks the table from its last block, but gives the blocks"),
    ("block_manager", walks_forward, "deallocate walks the table from its last block to its first"),
    ("block_manager", counts_nothing, "allocate counts each sequence it gives a table in stats"),
    ("block_manager", new_blocks_first, "allocate takes its hits first"),
    ("block_manager", last_copy_wins, "one copy per prefix: the first block hash_blocks publishes"),
    ("block_manager", publishes_at_allocate, "hash_blocks(seq, n) publishes the full blocks among the first n "
                                             "tokens, once their KV is computed"),
]


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@pytest.mark.parametrize("name", ["allocator", "block_table", "block_manager"])
def test_the_worked_solutions_pass(solution, name):
    """What the wrong parts below change is all that makes them fail."""
    assert check(name, solution[name]).passed


@pytest.mark.parametrize("name, make, rule", WRONG, ids=[f"{w[0]}-{w[1].__name__}" for w in WRONG])
def test_a_wrong_part_fails_with_the_rule_it_broke(solution, name, make, rule):
    assert first_hint_line(check(name, make(solution[name]))).startswith(rule)


# --- the package's own allocator -----------------------------------------------------------------

def allocator_state(allocator: PageAllocator):
    return allocator.free_pages, allocator.num_free, allocator.is_free(torch.arange(allocator.num_pages)).tolist()


@pytest.mark.parametrize("pages, says", [
    ([0, 0], "more than once"), ([1, 2, 1], "more than once"),
    ([-1], r"in \[0, 4\)"), ([4], r"in \[0, 4\)"), ([0, 9], r"in \[0, 4\)"),
    ([0, 3], "already free"),
])
def test_page_allocator_free_refuses_and_frees_nothing(pages, says):
    allocator = PageAllocator(4, device="cpu")
    allocator.alloc(3)   # pages 0, 1, 2 held; 3 free
    before = allocator_state(allocator)
    with pytest.raises(ValueError, match=says):
        allocator.free(torch.tensor(pages))
    assert allocator_state(allocator) == before == ([3], 1, [False, False, False, True])


@pytest.mark.parametrize("n, error", [(-1, ValueError), (-5, ValueError), (1.0, TypeError), (True, TypeError)])
def test_page_allocator_alloc_refuses_a_negative_count_and_takes_nothing(n, error):
    allocator = PageAllocator(4, device="cpu")
    allocator.alloc(3)
    before = allocator_state(allocator)
    with pytest.raises(error, match="pages to take"):
        allocator.alloc(n)
    assert allocator_state(allocator) == before == ([3], 1, [False, False, False, True])
    assert allocator.alloc(0).tolist() == []


def test_page_allocator_free_puts_pages_0_on_top():
    allocator = PageAllocator(4, device="cpu")
    allocator.alloc(3)
    allocator.free(torch.tensor([2, 0]))
    assert allocator.free_pages == [2, 0, 3] and allocator.alloc(1).tolist() == [2]
