"""Chapter 10's int4 pool, KIVI's layout (kvlearn.kivi): the bytes of a page, the window, and what a query reads."""

import pytest
import torch
import torch.nn.functional as F

from kvlearn import Engine, EngineConfig, KVPool
from kvlearn.attention import AttentionMetadata
from kvlearn.kivi import GROUP, KiviFormat, kivi_attention, pack, unpack

H, D = 2, 64


def test_a_page_of_keys_comes_back_within_half_a_step_per_channel():
    torch.manual_seed(0)
    keys = torch.randn(3, GROUP, H, D) * torch.logspace(-2, 1, D)   # channels of very different sizes
    keys[1, :, 0, 5] = 2.5                                           # a constant channel
    f = KiviFormat(torch.float32, D)
    rows = f.page_rows(keys)
    assert rows.shape == (3, GROUP, H, f.row) and f.row == D // 2 + D // 4
    step = (keys.amax(1) - keys.amin(1)) / 15                        # per channel: its own step
    error = (f.keys(rows) - keys).abs()
    assert (error <= step[:, None] * 0.5 + 2e-3 * keys.abs().amax(1)[:, None]).all()   # + float16 scales
    assert error[1, :, 0, 5].max() < 2e-3
    codes = torch.randint(0, 16, (5, D), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes)), codes) and pack(codes).shape == (5, D // 2)


def test_a_page_depends_on_its_own_keys_only():
    keys = torch.randn(4, GROUP, H, D)
    f = KiviFormat(torch.float32, D)
    assert torch.equal(f.page_rows(keys)[1:3], f.page_rows(keys[1:3]))


def steps(chunks, q, k, v, layers=2):
    """kivi_attention over one sequence fed `chunks` tokens a step, every layer in order (the same
    K and V in each); the outputs of the last layer."""
    pool = KVPool(layers, H, D, 64, page_size=GROUP, kv_cache_dtype="int4")
    slots, outs, start = pool.alloc(64), [], 0
    for n in chunks:
        md = AttentionMetadata.build([n], [slots[:start + n]])
        for layer in range(layers):
            out = kivi_attention(q[start:start + n], k[start:start + n], v[start:start + n], layer, pool, md)
        outs.append(out)
        start += n
    return torch.cat(outs), pool


def test_a_query_reads_earlier_pages_dequantized_and_its_own_page_exact_in_any_chunking():
    torch.manual_seed(1)
    n = 40
    q, k, v = torch.randn(n, 2 * H, D), torch.randn(n, H, D), torch.randn(n, H, D)
    whole, pool = steps([n], q, k, v)
    for chunks in ([7, 13, 20], [1] * n, [16, 16, 8]):
        assert torch.allclose(steps(chunks, q, k, v)[0], whole, atol=1e-5), chunks
    f = pool.format
    old_k = f.keys(f.page_rows(k[:32].view(2, GROUP, H, D))).reshape(32, H, D)
    old_v = f.values(pool.v[0][:32])
    for i in (3, 20, 39):   # by hand: the pages before the query's, dequantized; its own page, exact
        own = slice(i // GROUP * GROUP, i + 1)
        keys = torch.cat([old_k[:i // GROUP * GROUP], k[own]]).transpose(0, 1)
        values = torch.cat([old_v[:i // GROUP * GROUP], v[own]]).transpose(0, 1)
        expect = F.scaled_dot_product_attention(q[i][:, None], keys, values, enable_gqa=True)[:, 0]
        assert torch.allclose(whole[i], expect, atol=1e-5), i


def test_the_window_holds_partly_written_pages_and_forgets_filled_and_freed_ones():
    torch.manual_seed(2)
    q, k, v = torch.randn(40, 2 * H, D), torch.randn(40, H, D), torch.randn(40, H, D)
    _, pool = steps([20], q, k, v)
    assert sorted(pool.format.window) == [0, 1] and pool.format.filled == [0]   # page 0 filled in this step
    _, pool = steps([20, 1], q, k, v)
    assert sorted(pool.format.window) == [1]                 # the next step forgot the filled page
    pool.free(pool.slots_of(torch.tensor([1])))
    md = AttentionMetadata.build([1], [torch.tensor([0])])
    kivi_attention(q[:1], k[:1], v[:1], 0, pool, md)        # a step begins: the freed page is forgotten
    assert 1 not in pool.format.window


def test_an_int4_pool_says_what_it_needs():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        KVPool(1, 1, 8, 16, page_size=16, kv_cache_dtype="int4")
    pool = KVPool(1, H, D, 16, kv_cache_dtype="int4")   # page_size 1
    md = AttentionMetadata.build([1], [torch.tensor([0])])
    x = torch.randn(1, H, D)
    with pytest.raises(ValueError, match="page_size=16"):
        kivi_attention(torch.randn(1, 2 * H, D), x, x, 0, pool, md)
    with pytest.raises(ValueError, match="kivi_attention"):
        pool.store(0, torch.tensor([0]), x, x)
    with pytest.raises(ValueError, match="serves kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int4", parts={"quantizer": KiviFormat})


def test_an_int4_engine_without_pages_of_16_is_refused_when_built(model, tokenizer):
    with pytest.raises(ValueError, match="page_size=16"):
        Engine(model, tokenizer, kv_cache_dtype="int4", num_slots=64)   # radix: pages of 1 unless told


def test_int4_serves_the_same_tokens_in_any_chunking(model, tokenizer):
    prompts = [tokenizer.encode("A pool of pages, each a group of sixteen keys quantized per channel, and a window "
                                "of exact tokens for the page being written."), tokenizer.encode("Why?")]
    one = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=16, num_slots=256)
    chunked = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=16, num_slots=256, max_batch_tokens=7)
    expected = [o.token_ids for o in one.generate(prompts, max_new_tokens=6)]
    assert [o.token_ids for o in chunked.generate(prompts, max_new_tokens=6)] == expected
    assert len(chunked.pool.format.window) <= len(prompts)   # at most a partly written page per sequence


def test_int4_keeps_its_tokens_when_a_small_pool_preempts_and_evicts(model, tokenizer):
    text = tokenizer.encode("The ferry to the island leaves twice a day, once at seven in the morning and once at "
                            "four in the afternoon. In winter the afternoon crossing is often cancelled.")
    prompts = [text[i:i + 30] for i in range(4)]
    small = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=16, num_slots=96)
    roomy = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=16, num_slots=1024, cache="none")
    got = [o.token_ids for o in small.generate(prompts, max_new_tokens=20)]
    assert got == [o.token_ids for o in roomy.generate(prompts, max_new_tokens=20)]
    assert small.stats["preemptions"] > 0 and small.stats["evicted_tokens"] > 0   # pages freed and reused


def test_int4_pages_move_to_the_host_tier_and_back_with_their_scales(model, tokenizer):
    from kvlearn.serving.workloads import make_workload

    chat = make_workload("multi_turn", tokenizer, num_conversations=2, num_turns=2)
    longest = max(len(p) for p in chat.prompts) + 4
    small = -(-max(sum(len(p) + 4 for p in chat.prompts) // 5, longest) // GROUP) * GROUP
    tiered = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=GROUP, num_slots=small, host_slots=512)
    roomy = Engine(model, tokenizer, kv_cache_dtype="int4", page_size=GROUP, num_slots=2048)
    loaded = 0
    for turn in range(2):   # a round of both conversations at a time
        prompts = chat.prompt_lists()[2 * turn:2 * turn + 2]
        got = [o.token_ids for o in tiered.generate(prompts, max_new_tokens=4)]
        assert got == [o.token_ids for o in roomy.generate(prompts, max_new_tokens=4)]
        loaded += tiered.stats["loaded_from_host_tokens"]
    assert loaded > 0 and tiered.stats["offloaded_tokens"] > 0
