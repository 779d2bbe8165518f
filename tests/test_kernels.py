"""Chapter 5's attention done the GPU's way: each Triton kernel of `kvlearn.kernels` against chapter 5's
torch version, on shapes hypothesis draws (page sizes 1 and 16, contexts 1-300, GQA ratios 1 and 3,
ragged batches, scattered slots, a prefix shared by two sequences). On a CPU they run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the shapes stay small."""

import pytest

pytest.importorskip("triton", reason="Triton has no wheels for this platform (Linux only): the triton backend is "
                                     "refused here, and its kernel tests skip")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlearn.attention import AttentionMetadata, attend  # noqa: E402
from kvlearn.device import resolve_device  # noqa: E402
from kvlearn.kernels.decode import paged_decode_attention  # noqa: E402
from kvlearn.kernels.extend import extend_attention  # noqa: E402
from kvlearn.kernels.store import store_kvcache  # noqa: E402
from kvlearn.pool import KVPool  # noqa: E402

DEVICE = resolve_device(None)
TOL = dict(rtol=1e-5, atol=1e-5)
EXAMPLES = 25   # each example launches interpreted kernels: about 0.1-0.5 s on a CPU


@st.composite
def contexts(draw, decode: bool):
    """A pool with random K/V and a batch of sequences laid out in it: (pool, page_size, group,
    q_lens, token slots of each context, block table, scale)."""
    page = draw(st.sampled_from([1, 16]))
    group = draw(st.sampled_from([1, 3]))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([16, 64]))
    ctx = draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    q_lens = [1 if decode else draw(st.integers(1, min(c, 40))) for c in ctx]
    pages_of = [-(-c // page) for c in ctx]
    num_pages = sum(pages_of) + 1
    pool = KVPool(1, kv_heads, head_dim, num_pages * page, page_size=page, device=DEVICE)
    pool.kv.normal_(generator=torch.Generator(DEVICE).manual_seed(draw(st.integers(0, 2**16))))
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    tables, used = [], 0
    for n in pages_of:                                    # scattered pages, in a random order
        tables.append(order[used:used + n])
        used += n
    if len(ctx) >= 2:                                     # sequence 1 may share sequence 0's first pages
        cached = [(c - q) // page for c, q in zip(ctx[:2], q_lens[:2])]
        shared = draw(st.integers(0, min(cached)))
        tables[1] = torch.cat([tables[0][:shared], tables[1][shared:]])
    offsets = torch.arange(page)
    slots = [(t[:, None] * page + offsets).reshape(-1)[:c].to(DEVICE) for t, c in zip(tables, ctx)]
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(DEVICE)
    scale = draw(st.sampled_from([None, 0.3]))
    return pool, page, group, q_lens, slots, table, head_dim ** -0.5 if scale is None else scale


def packed_query(pool, group, num_tokens):
    """Queries laid out as the model hands them over: [T, heads, head_dim], not contiguous."""
    heads = pool.num_kv_heads * group
    return torch.randn(heads, num_tokens, pool.head_dim, device=DEVICE).transpose(0, 1)


@settings(max_examples=EXAMPLES)
@given(contexts(decode=True), st.sampled_from([None, 1, 2, 3, 5]))
def test_paged_decode_attention_equals_chapter_5(case, num_splits):
    pool, page, group, q_lens, slots, table, scale = case
    query = packed_query(pool, group, len(q_lens))
    md = AttentionMetadata.build(q_lens, slots)
    out = paged_decode_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, scale, page_size=page,
                                 num_splits=num_splits)
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, scale), **TOL)


@settings(max_examples=EXAMPLES)
@given(contexts(decode=False))
def test_extend_attention_equals_chapter_5(case):
    pool, page, group, q_lens, slots, table, scale = case
    query = packed_query(pool, group, sum(q_lens))
    md = AttentionMetadata.build(q_lens, slots)
    cu_q = F.pad(torch.tensor(q_lens, device=DEVICE).cumsum(0), (1, 0))
    out = extend_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, cu_q, scale, page_size=page)
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, scale), **TOL)


@settings(max_examples=EXAMPLES)
@given(st.integers(1, 40), st.sampled_from([1, 3]), st.sampled_from([16, 64]), st.integers(0, 2**16))
def test_store_kvcache_writes_exactly_the_step_slots(num_tokens, kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(2, kv_heads, head_dim, 64, device=DEVICE)
    pool.kv.normal_(generator=torch.Generator(DEVICE).manual_seed(seed))
    expected = KVPool(2, kv_heads, head_dim, 64, device=DEVICE)
    expected.kv.copy_(pool.kv)
    slots = torch.randperm(64, generator=gen)[:num_tokens].to(DEVICE)          # scattered, distinct
    key, value = (torch.randn(kv_heads, num_tokens, head_dim, generator=gen).transpose(0, 1).to(DEVICE)
                  for _ in range(2))
    store_kvcache(key, value, pool.k[1], pool.v[1], slots)
    expected.write(1, slots, key, value)
    assert torch.equal(pool.kv, expected.kv)   # the step's slots of layer 1, and nothing else


def test_a_context_shorter_than_its_splits_still_gives_the_softmax():
    """Splits with no positions (context 2, 5 splits) weigh nothing in the merge."""
    pool = KVPool(1, 3, 16, 8, device=DEVICE)
    pool.kv.normal_()
    slots = [torch.tensor([5, 2], device=DEVICE)]
    md = AttentionMetadata.build([1], slots)
    query = torch.randn(1, 9, 16, device=DEVICE)
    out = paged_decode_attention(query, pool.k[0], pool.v[0], slots[0][None], md.kv_lens, 0.25, num_splits=5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, 0.25), **TOL)


def test_a_cache_with_strided_rows_is_refused():
    pool = KVPool(1, 2, 16, 8, device=DEVICE)
    query = torch.randn(1, 2, 16, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache must have a contiguous last dimension.*contiguous\(\)"):
        paged_decode_attention(query, pool.k[0].transpose(1, 2), pool.v[0], table,
                               torch.ones(1, dtype=torch.int64, device=DEVICE), 0.25)


def test_the_triton_attention_meets_chapter_5s_attention_contract():
    """The learner's referee for chapter 5's attention part judges the kernels too (fewer programs
    than a learner's check: each call runs interpreted kernels)."""
    import kvlearn.parts
    from kvlearn.kernels.backend import triton_paged_attention

    report = kvlearn.parts.check("attention", triton_paged_attention, programs=30, time_limit_s=60)
    assert report.passed, report.message


def test_the_kernels_compile_for_an_h200():
    """The interpreter runs a kernel's Python; a GPU build also type-checks and lowers it. Triton
    compiles for sm_90 here, with no GPU, in a process that does not interpret."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernel_compile"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 6 and all(cubin == "True" for _, cubin, _ in lines), done.stdout   # machine code made
    assert all(int(shared) <= 100 * 1024 for _, _, shared in lines), done.stdout           # fits a GPU's shared memory
