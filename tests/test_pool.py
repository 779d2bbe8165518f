"""KVPool and ReqToTokenPool: layout, sizing, allocator invariants, bad input leaves them unchanged."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlearn.errors import KVCapacityError
from kvlearn.memory import KNOWN_CONFIGS, KVConfig
from kvlearn.pool import KVPool, ReqToTokenPool

SMOL = KNOWN_CONFIGS["SmolLM2-135M"]


def tiny(num_slots=16, page_size=1):
    return KVPool(2, 1, 2, num_slots, page_size=page_size, device="cpu")


def state(pool):
    """Everything the allocator exposes, to check that a refused call changed nothing."""
    return pool.num_free, pool.is_free(torch.arange(pool.num_slots)).tolist(), pool.kv.clone()


def assert_unchanged(pool, before):
    num_free, free_flags, kv = before
    assert pool.num_free == num_free
    assert pool.is_free(torch.arange(pool.num_slots)).tolist() == free_flags
    assert torch.equal(pool.kv, kv)


# --- layout and sizing ---------------------------------------------------------------------

def test_views_share_one_preallocated_tensor():
    pool = KVPool(3, 2, 4, 8, device="cpu")
    assert pool.k[1].shape == (8, 2, 4) and pool.v[2].shape == (8, 2, 4)
    pool.k[1][5] = 7.0
    pool.v[2][3] = -1.0
    assert (pool.kv[1, 0, 5] == 7.0).all() and (pool.kv[2, 1, 3] == -1.0).all()
    assert pool.kv.sum() == 7.0 * 2 * 4 - 1.0 * 2 * 4  # nothing else was touched
    assert pool.nbytes == pool.bytes_per_token * pool.num_slots


def test_bytes_per_token_is_the_chapter0_count():
    # SmolLM2 by hand: K and V, 30 layers, 3 KV heads, 64 dims, 4 bytes (fp32).
    pool = KVPool.for_model(SMOL, num_slots=4, device="cpu")
    assert pool.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert KVPool.for_model(SMOL, num_slots=4, dtype=torch.bfloat16, device="cpu").bytes_per_token == 23_040


def test_for_model_reads_a_transformers_config(model):
    pool = KVPool.for_model(model.config, num_slots=8, device="cpu")
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (30, 3, 64)


@pytest.mark.parametrize("page_size", [1, 16])
def test_budget_gives_whole_pages_that_fit(page_size):
    budget = 1000 * 46_080 + 123  # room for 1000 tokens and a bit
    pool = KVPool.for_model(SMOL, memory_budget_bytes=budget, page_size=page_size, device="cpu")
    assert pool.num_slots == 1000 // page_size * page_size
    assert pool.nbytes <= budget


@pytest.mark.parametrize("kwargs, error", [
    ({}, ValueError),                                                     # neither
    ({"num_slots": 4, "memory_budget_bytes": 10**6}, ValueError),         # both
    ({"memory_budget_bytes": 46_079}, ValueError),                        # less than one token
    ({"memory_budget_bytes": 46_080 * 15, "page_size": 16}, ValueError),  # less than one page
    ({"memory_budget_bytes": 0}, ValueError),
    ({"num_slots": 0}, ValueError),
    ({"num_slots": -3}, ValueError),
    ({"num_slots": 2.5}, TypeError),
    ({"num_slots": 20, "page_size": 16}, ValueError),                     # not whole pages
    ({"num_slots": 16, "page_size": 0}, ValueError),
])
def test_bad_sizes_are_refused(kwargs, error):
    with pytest.raises(error):
        KVPool.for_model(SMOL, device="cpu", **kwargs)


def test_mla_cannot_be_held_as_plain_k_and_v():
    with pytest.raises(ValueError, match="MLA"):
        KVPool.for_model(KNOWN_CONFIGS["DeepSeek-V3"], num_slots=4, device="cpu")


def test_bad_constructor_arguments():
    with pytest.raises(TypeError):
        KVPool(2, 1, 2, 8, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError):
        KVPool(0, 1, 2, 8, device="cpu")
    with pytest.raises(ValueError):
        KVPool(2, 1, 2, 8, device="tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_lives_on_cuda_when_asked():
    pool = KVPool(2, 1, 2, 8, device="cuda")
    assert pool.kv.is_cuda and pool.alloc(2).is_cuda


def test_repr_is_readable_and_stable():
    assert repr(KVPool.for_model(SMOL, num_slots=1024, device="cpu")) == (
        "KVPool(layers=30, kv_heads=3, head_dim=64, slots=1024, page_size=1, free=1024, dtype=float32, "
        "45.0 MiB, device=cpu)")


# --- allocator -----------------------------------------------------------------------------

def test_alloc_hands_out_distinct_slots_and_free_takes_them_back():
    pool = tiny(8)
    a, b = pool.alloc(3), pool.alloc(4)
    assert a.dtype == torch.int64 and len(set(a.tolist()) | set(b.tolist())) == 7
    assert pool.num_free == 1 and pool.num_used == 7
    pool.free(a)
    assert pool.num_free == 4
    assert sorted(pool.alloc(3).tolist()) == sorted(a.tolist())  # the freed ones are reused first
    assert pool.alloc(0).numel() == 0


def test_exhaustion_raises_and_takes_nothing():
    pool = tiny(8)
    pool.alloc(6)
    before = state(pool)
    with pytest.raises(KVCapacityError, match="2 free slots, 3 were asked"):
        pool.alloc(3)
    assert_unchanged(pool, before)
    assert pool.alloc(2).numel() == 2


@pytest.mark.parametrize("bad, error", [
    (lambda p, held: p.free(held[:1]), ValueError),                              # double free
    (lambda p, held: p.free(torch.tensor([3, 3])), ValueError),                  # same slot twice
    (lambda p, held: p.free(torch.tensor([8])), ValueError),                     # out of range
    (lambda p, held: p.free(torch.tensor([-1])), ValueError),
    (lambda p, held: p.free(torch.tensor([1.0])), TypeError),
    (lambda p, held: p.free(torch.tensor([held[1], 7])), ValueError),            # 7 is free
    (lambda p, held: p.alloc(-1), ValueError),
    (lambda p, held: p.alloc(2.0), TypeError),
    (lambda p, held: p.store(0, torch.tensor([1]), torch.zeros(1, 1, 3), torch.zeros(1, 1, 2)), ValueError),
    (lambda p, held: p.store(0, torch.tensor([1, 2]), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)), ValueError),
    (lambda p, held: p.store(0, torch.tensor([9]), torch.ones(1, 1, 2), torch.ones(1, 1, 2)), ValueError),
    (lambda p, held: p.store(2, torch.tensor([1]), torch.ones(1, 1, 2), torch.ones(1, 1, 2)), ValueError),
])
def test_bad_input_leaves_the_pool_unchanged(bad, error):
    pool = tiny(8)
    held = pool.alloc(4)
    pool.free(held[:1])
    before = state(pool)
    with pytest.raises(error):
        bad(pool, held)
    assert_unchanged(pool, before)


def test_store_writes_k_and_v_at_the_slots():
    pool = tiny(8)
    slots = torch.tensor([6, 2])
    k, v = torch.arange(4.0).reshape(2, 1, 2), -torch.arange(4.0).reshape(2, 1, 2)
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], v)
    assert pool.k[0].abs().sum() == 0


def test_pages_are_aligned_runs_of_slots():
    pool = tiny(64, page_size=4)
    slots = pool.alloc(12)
    pages = slots.reshape(-1, 4)
    assert (pages[:, 0] % 4 == 0).all()
    assert torch.equal(pages - pages[:, :1], torch.arange(4).expand(3, 4))
    before = state(pool)
    with pytest.raises(ValueError, match="multiple of 4"):
        pool.alloc(5)
    with pytest.raises(ValueError, match="whole pages"):
        pool.free(slots[:3])
    assert_unchanged(pool, before)
    pool.free(slots[4:8].flip(0))  # any order, as long as the page is whole
    assert pool.num_free == 64 - 8


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / free / refused calls against a plain Python model of who holds what."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(1, 12))
    def setup(self, page_size, num_pages):
        self.pool = tiny(page_size * num_pages, page_size)
        self.held = []  # tensors returned by alloc and not yet freed

    @rule(pages=st.integers(0, 14))
    def alloc(self, pages):
        n = pages * self.pool.page_size
        if n > self.pool.num_free:
            before = state(self.pool)
            with pytest.raises(KVCapacityError):
                self.pool.alloc(n)
            assert_unchanged(self.pool, before)
        else:
            slots = self.pool.alloc(n)
            assert slots.numel() == n and not self.pool.is_free(slots).any()
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        slots = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(slots)
        assert self.pool.is_free(slots).all()

    @precondition(lambda self: self.held and self.held[0].numel())
    @rule()
    def double_free_is_refused(self):
        freed = self.held.pop(0)
        self.pool.free(freed)
        before = state(self.pool)
        with pytest.raises(ValueError):
            self.pool.free(freed[: self.pool.page_size])
        assert_unchanged(self.pool, before)

    @invariant()
    def slots_are_conserved(self):
        if not hasattr(self, "pool"):
            return
        held = torch.cat(self.held) if self.held else torch.empty(0, dtype=torch.int64)
        assert held.unique().numel() == held.numel()  # nobody shares a slot
        assert self.pool.num_free + held.numel() == self.pool.num_slots
        assert int(self.pool.is_free(torch.arange(self.pool.num_slots)).sum()) == self.pool.num_free
        pages = held.reshape(-1, self.pool.page_size)
        assert (pages[:, 0] % self.pool.page_size == 0).all()


AllocatorMachine.TestCase.settings = settings(stateful_step_count=20)
test_allocator_state_machine = AllocatorMachine.TestCase


# --- req_to_token --------------------------------------------------------------------------

def test_req_to_token_rows_map_tokens_to_slots():
    table = ReqToTokenPool(max_requests=2, max_context_len=8, device="cpu")
    a = table.alloc()
    table.write(a, 0, torch.tensor([5, 9, 2]))
    table.write(a, 3, torch.tensor([7]))
    assert table.slots(a).tolist() == [5, 9, 2, 7]
    table.write(a, 1, torch.tensor([4]))  # rewrite from token 1: the row now ends there
    assert table.slots(a).tolist() == [5, 4]
    b = table.alloc()
    with pytest.raises(KVCapacityError):
        table.alloc()
    table.free(b)
    assert table.num_free == 1 and repr(table) == "ReqToTokenPool(rows=2, live=1, max_context_len=8)"


@pytest.mark.parametrize("bad", [
    lambda t, r: t.write(r, 3, torch.tensor([1])),         # a hole after the 2 known tokens
    lambda t, r: t.write(r, 0, torch.arange(9)),           # longer than max_context_len
    lambda t, r: t.write(1, 0, torch.tensor([1])),         # row 1 was never allocated
    lambda t, r: t.slots(7),
    lambda t, r: t.free(1),
])
def test_req_to_token_bad_input_changes_nothing(bad):
    table = ReqToTokenPool(max_requests=2, max_context_len=8, device="cpu")
    row = table.alloc()
    table.write(row, 0, torch.tensor([3, 4]))
    with pytest.raises(ValueError):
        bad(table, row)
    assert table.slots(row).tolist() == [3, 4] and table.num_free == 1


def test_req_to_token_double_free():
    table = ReqToTokenPool(max_requests=2, max_context_len=8, device="cpu")
    row = table.alloc()
    table.free(row)
    with pytest.raises(ValueError, match="not a live request row"):
        table.free(row)
    assert table.num_free == 2


def test_kvconfig_gives_the_same_pool_as_its_numbers():
    cfg = KVConfig("toy", "GQA", 2, 4, 2, 8)
    pool = KVPool.for_model(cfg, num_slots=3, device="cpu")
    assert pool.kv.shape == (2, 2, 3, 2, 8)


# --- pictures ------------------------------------------------------------------------------

def test_pool_text_marks_owners_free_and_unnamed_slots():
    from kvlearn.viz import pool_text

    pool = tiny(12, page_size=2)
    a, b, other = pool.alloc(4), pool.alloc(2), pool.alloc(2)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5] and other.tolist() == [6, 7]
    assert pool_text(pool, {"req 0": a, "req 1": b}, width=8) == "\n".join([
        "12 slots, page_size 2, 4 free",
        "    0  AA AA BB ##",
        "    8  .. ..",
        "  A = req 0",
        "  B = req 1",
    ])  # first letters clash: A, B, ...
    assert pool_text(pool, {"x": a, "y": b}, width=8).splitlines()[1:3] == ["    0  xx xx yy ##", "    8  .. .."]


def test_draw_pool_makes_a_figure():
    import matplotlib

    matplotlib.use("Agg")
    from kvlearn.viz import draw_pool

    pool = tiny(8)
    fig = draw_pool(pool, {"req 0": pool.alloc(3)})
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["req 0", "free"]


def test_free_and_rows_refuse_floats_and_bools():
    pool = KVPool(1, 1, 1, 4)
    held = pool.alloc(3)
    for bad in ([0.9, 1.7], [True, False], torch.tensor([0.0])):
        with pytest.raises(TypeError, match="integers"):
            pool.free(bad)
    assert pool.num_free == 1 and not pool.is_free(held).any()
    rows = ReqToTokenPool(max_requests=2, max_context_len=4)
    rows.alloc()
    with pytest.raises(ValueError, match="live request row"):
        rows.write(True, 0, torch.tensor([5]))
