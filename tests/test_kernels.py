"""Chapter 5's attention done the GPU's way: each Triton kernel of `kvlearn.kernels` against chapter 5's
torch version, on shapes hypothesis draws (page sizes 1 and 16, contexts 1-300, GQA ratios 1 and 3,
ragged batches, scattered slots, a prefix shared by two sequences), at head_dims that are not a
power of two, with bfloat16 caches, int32 tables, padding slots and a stage-1 kernel of one's own.
On a CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the shapes
stay small. Bad input: tests/test_kernels_refusals.py."""

import pytest

pytest.importorskip("triton", reason="Triton has no wheels for this platform (Linux only): the triton backend is "
                                     "refused here, and its kernel tests skip")

import inspect  # noqa: E402
import linecache  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlearn.attention import AttentionMetadata, attend  # noqa: E402
from kvlearn.device import resolve_device  # noqa: E402
from kvlearn.kernels import decode  # noqa: E402
from kvlearn.kernels.backend import triton_paged_attention  # noqa: E402
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
    head_dim = draw(st.sampled_from([16, 64, 80]))
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
        cached = [(c - q) // page for c, q in zip(ctx[:2], q_lens[:2], strict=True)]
        shared = draw(st.integers(0, min(cached)))
        tables[1] = torch.cat([tables[0][:shared], tables[1][shared:]])
    offsets = torch.arange(page)
    slots = [(t[:, None] * page + offsets).reshape(-1)[:c].to(DEVICE) for t, c in zip(tables, ctx, strict=True)]
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(DEVICE)
    scale = draw(st.sampled_from([None, 0.3]))
    return pool, page, group, q_lens, slots, table, head_dim ** -0.5 if scale is None else scale


def packed_query(pool, group, num_tokens):
    """Queries laid out as the model hands them over: [T, heads, head_dim], not contiguous."""
    heads = pool.num_kv_heads * group
    return torch.randn(heads, num_tokens, pool.head_dim, device=DEVICE).transpose(0, 1)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@settings(max_examples=EXAMPLES)
@given(contexts(decode=True), st.sampled_from([None, 1, 2, 3, 5]))
def test_paged_decode_attention_equals_chapter_5(case, num_splits):
    pool, page, group, q_lens, slots, table, scale = case
    query = packed_query(pool, group, len(q_lens))
    md = AttentionMetadata.build(q_lens, slots)
    out = paged_decode_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, scale, page_size=page,
                                 num_splits=num_splits)
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, scale), **TOL)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
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
@given(st.integers(1, 40), st.sampled_from([1, 3]), st.sampled_from([16, 64, 80]), st.integers(0, 2**16))
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
    pool = KVPool(1, 2, 32, 8, device=DEVICE)
    query = torch.randn(1, 2, 16, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache must have a contiguous last dimension.*contiguous\(\)"):
        paged_decode_attention(query, pool.k[0][..., ::2], pool.v[0][..., ::2], table,
                               torch.ones(1, dtype=torch.int64, device=DEVICE), 0.25)


def step(head_dim: int, dtype=torch.float32, index=torch.int64, kv_heads: int = 2, group: int = 3):
    """One step of two sequences over a pool of scattered slots (page_size 1), every other slot
    holding K/V too: contexts 70 and 20 with 5 and 20 new tokens, whose K and V `store_kvcache`
    writes. (pool, key, value, new tokens' slots, per-sequence context slots, table, kv_lens, query)."""
    gen = torch.Generator().manual_seed(head_dim)
    pool = KVPool(1, kv_heads, head_dim, 128, dtype=dtype, device=DEVICE)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    perm = torch.randperm(128, generator=gen).to(DEVICE)
    slots, q_lens = [perm[:70], perm[70:90]], [5, 20]
    new = torch.cat([s[-q:] for s, q in zip(slots, q_lens, strict=True)])
    key, value = (torch.randn(len(new), kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    table = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True).to(index)
    query = torch.randn(len(new), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    return pool, key, value, new, slots, q_lens, table, query


@pytest.mark.parametrize("head_dim", [80, 96, 8])
def test_head_dims_that_are_not_a_power_of_two_equal_sdpa(head_dim):
    """80 and 96 occur in real models; 8 is below tl.dot's 16. The kernels pad the tile to
    `tile(head_dim)` and mask the rest: the write, the extend and the decode (two splits) equal
    chapter 5's (SDPA over a gather)."""
    pool, key, value, new, slots, q_lens, table, query = step(head_dim)
    expected = KVPool(1, pool.num_kv_heads, head_dim, 128, device=DEVICE)
    expected.kv.copy_(pool.kv)
    expected.write(0, new, key, value)
    store_kvcache(key, value, pool.k[0], pool.v[0], new)
    assert torch.equal(pool.kv, expected.kv)
    scale = head_dim ** -0.5
    md = AttentionMetadata.build(q_lens, slots)
    cu_q = F.pad(torch.tensor(q_lens, device=DEVICE).cumsum(0), (1, 0))
    out = extend_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, cu_q, scale)
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, scale), **TOL)
    decode_md = AttentionMetadata.build([1, 1], slots)
    last = query[cu_q[1:] - 1]                        # each sequence's last new token, as a decode step
    out = paged_decode_attention(last, pool.k[0], pool.v[0], table, md.kv_lens, scale, num_splits=2)
    torch.testing.assert_close(out, attend(last, pool.k[0], pool.v[0], decode_md, scale), **TOL)


def test_a_bfloat16_cache_gives_chapter_5s_attention_to_bfloat16_precision():
    """Products in the cache's dtype (in the interpreter: float32, see `dot_dtype`), float32 sums."""
    pool, key, value, new, slots, q_lens, table, query = step(64, dtype=torch.bfloat16)
    store_kvcache(key, value, pool.k[0], pool.v[0], new)
    md = AttentionMetadata.build(q_lens, slots)
    cu_q = F.pad(torch.tensor(q_lens, device=DEVICE).cumsum(0), (1, 0))
    out = extend_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, cu_q, 0.125)
    assert out.dtype == torch.bfloat16
    reference = attend(query.float(), pool.k[0].float(), pool.v[0].float(), md, 0.125)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
    last = query[cu_q[1:] - 1]
    out = paged_decode_attention(last, pool.k[0], pool.v[0], table, md.kv_lens, 0.125, num_splits=2)
    decode_md = AttentionMetadata.build([1, 1], slots)
    reference = attend(last.float(), pool.k[0].float(), pool.v[0].float(), decode_md, 0.125)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def test_int32_tables_and_slots_give_what_int64_ones_give():
    """SGLang's req_to_token is int32: the kernels widen each slot to int64 before the offset."""
    pool, key, value, new, slots, q_lens, table, query = step(64)
    pool32 = KVPool(1, pool.num_kv_heads, 64, 128, device=DEVICE)
    pool32.kv.copy_(pool.kv)
    store_kvcache(key, value, pool.k[0], pool.v[0], new)
    store_kvcache(key, value, pool32.k[0], pool32.v[0], new.int())
    assert torch.equal(pool32.kv, pool.kv)
    md = AttentionMetadata.build(q_lens, slots)
    cu_q = F.pad(torch.tensor(q_lens, device=DEVICE).cumsum(0), (1, 0))
    wide = extend_attention(query, pool.k[0], pool.v[0], table, md.kv_lens, cu_q, 0.125)
    narrow = extend_attention(query, pool.k[0], pool.v[0], table.int(), md.kv_lens.int(), cu_q.int(), 0.125)
    assert torch.equal(wide, narrow)
    last = query[cu_q[1:] - 1]
    assert torch.equal(paged_decode_attention(last, pool.k[0], pool.v[0], table, md.kv_lens, 0.125),
                       paged_decode_attention(last, pool.k[0], pool.v[0], table.int(), md.kv_lens.int(), 0.125))


def test_slot_minus_one_is_padding_that_store_kvcache_skips():
    """nano-vllm's rule: a token whose slot is -1 is written nowhere; the others are written."""
    pool, key, value, new, slots, q_lens, table, query = step(16)
    padded = new.clone()
    padded[::2] = -1
    expected = KVPool(1, pool.num_kv_heads, 16, 128, device=DEVICE)
    expected.kv.copy_(pool.kv)
    expected.write(0, new[1::2], key[1::2], value[1::2])
    store_kvcache(key, value, pool.k[0], pool.v[0], padded)
    assert torch.equal(pool.kv, expected.kv)


# --- an int8 pool (chapter 10): quantized in the store kernel, dequantized in extend's tile load -----

def int8_copy(pool: KVPool) -> KVPool:
    """An int8 pool of `pool`'s shape holding its K and V, encoded by chapter 10's torch format."""
    int8 = KVPool(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.num_slots, page_size=pool.page_size,
                  device=DEVICE, kv_cache_dtype="int8")
    every = torch.arange(pool.num_slots, device=DEVICE)
    for layer in range(pool.num_layers):
        int8.write(layer, every, pool.k[layer], pool.v[layer])
    return int8


@settings(max_examples=EXAMPLES)
@given(st.integers(2, 40), st.sampled_from([1, 3]), st.sampled_from([16, 64, 80]), st.integers(0, 2**16))
def test_an_int8_store_writes_the_bytes_of_the_torch_format(num_tokens, kv_heads, head_dim, seed):
    """The kernel's scale, clamp and rounding are Int8Format.encode's, byte for byte: an all-zero
    row, an outlier, ties (a row whose scale is 1, all its numbers halves: ties go to even), and a
    padding slot -1, written nowhere."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(2, kv_heads, head_dim, 64, device=DEVICE, kv_cache_dtype="int8")
    pool.kv.copy_(torch.randint(0, 256, pool.kv.shape, generator=gen, dtype=torch.uint8))
    expected = KVPool(2, kv_heads, head_dim, 64, device=DEVICE, kv_cache_dtype="int8")
    expected.kv.copy_(pool.kv)
    slots = torch.randperm(64, generator=gen)[:num_tokens].to(DEVICE)
    key, value = (3 * torch.randn(kv_heads, num_tokens, head_dim, generator=gen).transpose(0, 1) for _ in range(2))
    key[0] = 0.0
    value[-1, 0, 0] = 1000.0
    key[1, 0] = torch.arange(head_dim) % 9 - 4.5
    key[1, 0, 0] = 127.0                                          # scale 127 / 127 = 1: codes x, ties
    padded = slots.clone()
    padded[-1] = -1
    codes_k, scale_k = pool.format.unpack(pool.k[1])
    codes_v, scale_v = pool.format.unpack(pool.v[1])
    store_kvcache(key.to(DEVICE), value.to(DEVICE), codes_k, codes_v, padded, scale_k, scale_v)
    expected.write(1, slots[:-1], key[:-1].to(DEVICE), value[:-1].to(DEVICE))
    assert torch.equal(pool.kv, expected.kv)   # layer 1's step slots, but the padded one, and nothing else


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@settings(max_examples=10)
@given(contexts(decode=False))
def test_extend_attention_on_an_int8_pool_equals_chapter_5s_decoded_rows(case):
    float_pool, page, group, q_lens, slots, table, scale = case
    pool = int8_copy(float_pool)
    query = packed_query(pool, group, sum(q_lens))
    md = AttentionMetadata.build(q_lens, slots)
    cu_q = F.pad(torch.tensor(q_lens, device=DEVICE).cumsum(0), (1, 0))
    (codes_k, scale_k), (codes_v, scale_v) = pool.format.unpack(pool.k[0]), pool.format.unpack(pool.v[0])
    out = extend_attention(query, codes_k, codes_v, table, md.kv_lens, cu_q, scale, page_size=page,
                           k_scale=scale_k, v_scale=scale_v)
    torch.testing.assert_close(out, attend(query, pool.k[0], pool.v[0], md, scale, pool.format.decode), **TOL)


def test_the_triton_backend_serves_an_int8_pool_as_chapter_5_does():
    """A prefill step, then a decode step (through the extend kernel: the decode kernel, chapter 5's
    exercise, reads float pools), with the pool's bytes and the outputs of chapter 5's torch path."""
    from kvlearn.attention import paged_attention

    float_pool, key, value, new, slots, q_lens, table, query = step(64)
    pools = [int8_copy(float_pool) for _ in range(2)]
    steps = [(AttentionMetadata.build(q_lens, slots), query, key, value)]
    last = [s[-1:] for s in slots]
    steps.append((AttentionMetadata.build([1, 1], slots), query[[4, 24]], key[[4, 24]] * 2, value[[4, 24]]))
    assert [int(s) for s in steps[1][0].slot_mapping] == [int(s) for s in torch.cat(last)]
    for md, q, k, v in steps:
        ours = triton_paged_attention(q, k, v, 0, pools[0], md, 0.125)
        torch.testing.assert_close(ours, paged_attention(q, k, v, 0, pools[1], md, 0.125), **TOL)
        assert torch.equal(pools[0].kv, pools[1].kv)


def kernel_from_source(source: str):
    """A stage-1 kernel as a learner writes one in a notebook cell: its own @triton.jit function. IPython
    keeps each cell's source in linecache, where Triton's GPU compiler reads it (the interpreter needs
    none): so does this, under a name of its own."""
    name = f"<learner's cell {len(linecache.cache)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    namespace = {"triton": triton, "tl": tl}
    exec(compile(source, name, "exec"), namespace)
    return namespace["decode_kernel"]


def test_a_stage1_kernel_of_ones_own_runs_in_the_worked_ones_place():
    """The exercise's hook: a copy of the worked kernel gives the same numbers, and a changed copy
    changes them (so the launcher, and triton_paged_attention's keyword, run the kernel given)."""
    pool, key, value, new, slots, q_lens, table, query = step(64)
    md = AttentionMetadata.build(q_lens, slots)
    last = query[md.last_token]
    source = inspect.getsource(decode.decode_kernel.fn)
    copy = kernel_from_source(source)
    assert copy is not decode.decode_kernel
    worked = paged_decode_attention(last, pool.k[0], pool.v[0], table, md.kv_lens, 0.125, num_splits=2)
    assert torch.equal(paged_decode_attention(last, pool.k[0], pool.v[0], table, md.kv_lens, 0.125, num_splits=2,
                                              stage1=copy), worked)
    halved = kernel_from_source(source.replace("* scale", "* scale * 0.5"))
    step_md = AttentionMetadata.build([1, 1], slots)                # a decode step: each last token's K/V again
    k_new, v_new = pool.k[0][step_md.slot_mapping].clone(), pool.v[0][step_md.slot_mapping].clone()
    kwargs = dict(layer=0, kv_pool=pool, md=step_md, scale=0.125)
    assert torch.allclose(triton_paged_attention(last, k_new, v_new, **kwargs), worked, **TOL)
    assert not torch.allclose(triton_paged_attention(last, k_new, v_new, stage1=halved, **kwargs), worked, **TOL)


def test_a_stage1_that_is_not_a_kernel_with_the_worked_signature_is_refused():
    pool, key, value, new, slots, q_lens, table, query = step(16)
    md = AttentionMetadata.build(q_lens, slots)
    args = (query[md.last_token], pool.k[0], pool.v[0], table, md.kv_lens, 0.25)
    with pytest.raises(TypeError, match=r"stage1 must be a Triton kernel.*@triton.jit"):
        paged_decode_attention(*args, stage1=decode.decode_kernel.fn)    # the plain Python function
    source = inspect.getsource(decode.decode_kernel.fn)
    fewer = kernel_from_source(source.replace("stride_lb, stride_lh,", "stride_lb,"))
    with pytest.raises(TypeError, match=r"stage1 must take exactly the parameters of decode_kernel.*stride_lh"):
        paged_decode_attention(*args, stage1=fewer)


@pytest.mark.slow   # 10 s or more: `make quick` leaves it out
@pytest.mark.skipif(DEVICE.type == "cuda", reason="the attention suite's pools are on the CPU, where compiled kernels "
                    "cannot run; on CUDA the tests above compare the kernels with chapter 5's attention")
def test_the_triton_attention_meets_chapter_5s_attention_contract():
    """The learner's referee for chapter 5's attention part judges the kernels too (fewer programs
    than a learner's check: each call runs interpreted kernels)."""
    import kvlearn.parts

    report = kvlearn.parts.check("attention", triton_paged_attention, programs=30, time_limit_s=60)
    assert report.passed, report.message


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_the_kernels_compile_for_an_h200():
    """The interpreter runs a kernel's Python; a GPU build also type-checks and lowers it. Triton
    compiles for sm_90 here, with no GPU, in a process that does not interpret."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.kernel_compile import cases

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernel_compile"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [name for name, *_ in lines] == [f"{k.__name__}[{variant}]" for k, variant, *_ in cases()], done.stdout
    assert all(cubin == "True" for _, cubin, _, _ in lines), done.stdout              # machine code made
    assert all(int(shared) <= 100 * 1024 for _, _, shared, _ in lines), done.stdout   # fits a GPU's shared memory
    # A bfloat16 cache's products run on the tensor cores (mma); a float32 cache's stay exact (ieee).
    for name, _, _, mma in lines:
        dots = name.startswith(("decode_kernel", "extend_kernel"))
        assert (mma == "True") == (dots and "bf16" in name), done.stdout
