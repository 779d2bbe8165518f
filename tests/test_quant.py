"""Chapter 10: quantized KV formats (kvlearn.quant) in chapter 4's pool, served by the engine."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlearn import Engine, EngineConfig, KVPool
from kvlearn.formats import KV_CACHE_DTYPES
from kvlearn.memory import KVConfig
from kvlearn.quant import (
    FORMATS,
    Int8Format,
    PerLayerScale,
    Rounding,
    calibrated_scales,
    perplexity_and_kl,
    round_per_channel,
    round_per_token,
    simulated_attention,
)

QUANTIZED = sorted(FORMATS)
D = 8   # head_dim of the property tests


def fmt(name, head_dim=D):
    return KV_CACHE_DTYPES[name](torch.float32, head_dim)


rows = arrays("float32", st.tuples(st.integers(1, 4), st.just(D)),
              elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False))


# The largest error a format may make on each value of a row, from the row's absmax: int8 half a
# step; fp8 e4m3 a 2^-4 relative step (3 mantissa bits), or half a subnormal step (2^-9 of the scale).
BOUNDS = {"int8": lambda x, absmax: absmax / 127 / 2,
          "fp8_e4m3": lambda x, absmax: torch.maximum(x.abs() * 2.0 ** -4, absmax / 448 * 2.0 ** -10)}


@pytest.mark.parametrize("name", QUANTIZED)
@settings(max_examples=300)
@given(x=rows)
def test_a_round_trip_is_within_the_formats_bound(name, x):
    x = torch.from_numpy(x)
    f = fmt(name)
    back = f.decode(f.encode(x), torch.float32)
    absmax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= BOUNDS[name](x, absmax) + absmax * 1e-6).all()   # + float32's own rounding


@pytest.mark.parametrize("name", QUANTIZED)
def test_an_all_zero_row_and_saturation(name):
    f = fmt(name)
    x = torch.zeros(3, 2, D)
    x[1, 0] = torch.tensor([1e30, -3.0, 0.5, 0, 0, 0, 0, 2.0])   # a huge value sets the scale
    x[2, 1] = torch.full((D,), -7.0)                              # every value at the absmax
    rows = f.encode(x)
    assert rows.shape == (3, 2, D + 4) and rows.dtype == torch.uint8
    back = f.decode(rows, torch.float32)
    assert torch.equal(back[0], torch.zeros(2, D)) and torch.equal(back[1, 1], torch.zeros(D))
    codes, _ = f.quantize(x)
    assert codes.float().abs().max() == f.qmax                    # saturates at the format's largest code
    assert math.isclose(back[1, 0, 0], 1e30, rel_tol=1e-6) and torch.allclose(back[2, 1], x[2, 1])
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_encode_is_row_local_so_the_same_k_gives_the_same_bytes(name):
    x = torch.randn(6, 3, 64)
    f = fmt(name, 64)
    assert torch.equal(f.encode(x)[2:4], f.encode(x[2:4]))


def test_bytes_per_token_counts_the_scales_and_names_are_checked():
    sizes = {name: KVPool(30, 3, 64, 16, kv_cache_dtype=name).bytes_per_token for name in KV_CACHE_DTYPES}
    assert sizes == {"auto": 2 * 30 * 3 * 64 * 4, "bfloat16": 2 * 30 * 3 * 64 * 2, "fp8_e4m3": 2 * 30 * 3 * (64 + 4),
                     "int8": 2 * 30 * 3 * (64 + 4), "int4": 2 * 30 * 3 * (32 + 16)}
    pool = KVPool(2, 3, 64, 16, kv_cache_dtype="int8")
    assert pool.nbytes == pool.bytes_per_token * 16
    with pytest.raises(ValueError, match="'auto', 'bfloat16', 'fp8_e4m3', 'int4', 'int8'"):
        KVPool(2, 3, 64, 16, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int2'"):
        EngineConfig(kv_cache_dtype="int2")
    with pytest.raises(ValueError, match="multiple of 4"):
        KVPool(2, 3, 6, 16, kv_cache_dtype="int8")
    cfg = KVConfig("smollm2-like", "GQA", 30, 9, 3, 64)
    for name, per_token in sizes.items():   # a memory budget buys slots at the format's bytes per token
        pool = KVPool.for_model(cfg, memory_budget_bytes=per_token * 100 + 1, page_size=16, kv_cache_dtype=name)
        assert pool.num_slots == 96 and pool.bytes_per_token == per_token
    assert set(QUANTIZED) < set(KV_CACHE_DTYPES)   # kvlearn/__init__ registers every chapter-10 format


def test_the_fast_path_refuses_a_quantized_pool_and_the_kernels_read_int8_only():
    for options in (dict(kv_cache_dtype="int8", fast=True), dict(kv_cache_dtype="fp8_e4m3", attention_backend="triton"),
                    dict(kv_cache_dtype="int4", attention_backend="triton"), dict(kv_cache_dtype="int4", fast=True),
                    dict(kv_cache_dtype="bfloat16", parts={"attention": lambda *a: None}),
                    dict(kv_cache_dtype="int8", attention_backend="triton", parts={"quantizer": Int8Format}),
                    dict(kv_cache_dtype="int8", attention_backend="triton", parts={"decode_kernel": lambda: None})):
        with pytest.raises(ValueError, match="read by chapter 5's torch attention"):
            EngineConfig(**options)
    assert EngineConfig(kv_cache_dtype="int8", attention_backend="triton").attention_backend == "triton"
    pytest.importorskip("triton")
    from kvlearn.kernels.backend import triton_paged_attention

    pool = KVPool(1, 1, 8, 4, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        triton_paged_attention(None, None, None, 0, pool, None)


# --- the real model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tokenizer):
    prefix = tokenizer.encode("The KV cache keeps the keys and values of every token a model has read, "
                              "so that the next token costs one step, not a whole pass.")
    return prefix, [prefix + tokenizer.encode(" Say it again."), prefix + tokenizer.encode(" Why?")]


@pytest.mark.parametrize("name", sorted(KV_CACHE_DTYPES))
def test_caches_give_the_no_cache_tokens_and_reuse_quantized_pages_as_they_are(model, tokenizer, prompts, name):
    prefix, two = prompts   # pages of 16 tokens, as int4 needs (a key group is a page)
    expected = [o.token_ids for o in Engine(model, tokenizer, cache="none", kv_cache_dtype=name, page_size=16,
                                            num_slots=256).generate(two, max_new_tokens=4)]
    for cache in ("radix", "blocks"):
        engine = Engine(model, tokenizer, cache=cache, kv_cache_dtype=name, num_slots=256, page_size=16)
        first = engine.generate(two[:1], max_new_tokens=4)[0].token_ids
        before = engine.pool.kv.clone()
        second = engine.generate(two[1:], max_new_tokens=4)[0].token_ids
        assert [first, second] == expected, cache
        assert engine.stats["cached_tokens"] >= len(prefix) // 16 * 16 > 0
        if cache == "radix":   # the prefix's rows, scales included, were read again, not rewritten
            slots = engine.cache.match_prefix(prefix).indices
            assert len(slots) == len(prefix) // 16 * 16 > 0   # whole pages
            assert torch.equal(engine.pool.kv[:, :, slots], before[:, :, slots])


def test_perplexity_is_teacher_forced_through_the_pool(model, tokenizer):
    ids = tokenizer.encode("Every chapter runs on a laptop CPU, offline, with a real trained model.")
    ppl, kl, logp = perplexity_and_kl(model, ids, "auto", chunk=5)
    with torch.no_grad():
        hf = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    assert torch.allclose(logp, hf, atol=1e-4)
    assert math.isclose(ppl, math.exp(-float(hf.gather(1, torch.tensor(ids[1:])[:, None]).mean())), rel_tol=1e-4)
    _, kl_auto, _ = perplexity_and_kl(model, ids, "auto", reference=logp)
    _, kl_int8, _ = perplexity_and_kl(model, ids, "int8", reference=logp)
    assert kl_auto < 1e-9 < kl_int8 < 0.05


def test_a_demoted_page_on_disk_is_smaller_quantized_and_comes_back(model, tokenizer, prompts, tmp_path):
    prefix, two = prompts
    sizes, out = {}, {}
    for name in ("auto", "int8", "int4"):
        folder = tmp_path / name
        folder.mkdir()
        engine = Engine(model, tokenizer, kv_cache_dtype=name, num_slots=256, page_size=16, disk_dir=folder,
                        write_policy="write_through")
        out[name] = engine.generate(two[:1], max_new_tokens=4)[0].token_ids
        files = list(folder.glob("*.kv"))
        assert files
        sizes[name] = max(f.stat().st_size for f in files)
    assert sizes["int4"] < sizes["int8"] < sizes["auto"] * 0.3
    for name in ("int8", "int4"):
        restarted = Engine(model, tokenizer, kv_cache_dtype=name, num_slots=256, page_size=16, disk_dir=tmp_path / name)
        assert restarted.generate(two[:1], max_new_tokens=4)[0].token_ids == out[name]
        assert restarted.stats["loaded_from_disk_tokens"] > 0
    foreign = Engine(model, tokenizer, kv_cache_dtype="fp8_e4m3", num_slots=256, disk_dir=tmp_path / "int8")
    foreign.generate(two[:1], max_new_tokens=1)
    assert foreign.stats["loaded_from_disk_tokens"] == 0   # another format's bytes are never read as its own


# --- simulated layouts (int4 the KIVI way) ----------------------------------------------------------

def test_symmetric_rounding_per_token_at_8_bits_is_the_pools_int8():
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 3, 64)
    x[2, 1] = 0.0
    f = fmt("int8", 64)
    assert torch.equal(round_per_token(x, 8, symmetric=True), f.decode(f.encode(x), torch.float32))


@settings(max_examples=200)
@given(x=rows)
def test_asymmetric_rounding_is_within_half_a_step_and_keeps_min_and_max(x):
    x = torch.from_numpy(x)
    back = round_per_token(x, 4, symmetric=False)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    assert ((back - x).abs() <= step / 2 + (hi - lo).abs() * 1e-6 + 1e-6).all()
    assert (torch.allclose(back.amin(-1, keepdim=True), lo, atol=1e-3) and
            torch.allclose(back.amax(-1, keepdim=True), hi, atol=1e-3))


def test_rounding_per_channel_keeps_groups_apart_and_leaves_the_tail():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 70, 8)
    x[..., 5] *= 100                                          # an outlier channel
    back = round_per_channel(x, 4, group=32)
    assert torch.equal(back[:, :, 64:], x[:, :, 64:])        # 6 tokens after the last whole group
    later = x.clone()
    later[:, :, 40] += 1000                                   # a change in the second group ...
    assert torch.equal(round_per_channel(later, 4, 32)[:, :, :32], back[:, :, :32])   # ... leaves the first
    step = (x[:, :, :64].unflatten(2, (2, 32)).amax(3) - x[:, :, :64].unflatten(2, (2, 32)).amin(3)) / 15
    err = (back[:, :, :64] - x[:, :, :64]).abs().unflatten(2, (2, 32)).amax(3)
    assert (err <= step / 2 + 1e-4).all()                    # each channel's error is its own step's
    assert (round_per_channel(x, 4, 32)[..., :64, 0] - x[..., :64, 0]).abs().max() < 1   # outlier stays in its channel


def test_a_window_rounds_only_whole_groups_that_were_cached():
    k, v = torch.randn(2, 1, 80, 8), torch.randn(2, 1, 80, 8)
    kivi = Rounding(4, keys="channel", symmetric=False, window=True)
    rk, rv = kivi(k, v, torch.tensor([70, 31]), 0)
    assert not torch.equal(rk[0, :, :64], k[0, :, :64]) and torch.equal(rk[0, :, 64:], k[0, :, 64:])
    assert torch.equal(rk[1], k[1]) and torch.equal(rv[1], v[1])         # 31 cached: no whole group yet
    assert torch.equal(rv[0, :, :64], round_per_token(v[0, :, :64], 4, symmetric=False))
    per_token = Rounding(4)
    assert torch.equal(per_token(k, v, torch.tensor([0, 0]), 3)[0], round_per_token(k, 4, symmetric=True))
    with pytest.raises(ValueError, match="window=True"):
        Rounding(4, keys="channel")
    with pytest.raises(ValueError, match="'token' or 'channel'"):
        Rounding(4, keys="head")


def test_simulated_bytes_per_token_count_codes_scales_and_minimums():
    shape = (30, 3, 64)   # SmolLM2: K and V rows of 64 values, 90 (layer, KV head) pairs
    assert Rounding(4).bytes_per_token(*shape) == 90 * 2 * (32 + 4)
    assert Rounding(4, symmetric=False).bytes_per_token(*shape) == 90 * 2 * (32 + 8)
    assert Rounding(4, keys="channel", symmetric=False, window=True).bytes_per_token(*shape) == 90 * (32 + 16 + 32 + 8)
    assert Rounding(8).bytes_per_token(*shape) == KVPool(*shape, 1, kv_cache_dtype="int8").bytes_per_token


def test_a_simulation_at_8_bits_scores_as_the_int8_pool(model, tokenizer):
    ids = tokenizer.encode("A quantized pool keeps fewer bytes per token; the simulation rounds as attention reads.")
    _, _, ref = perplexity_and_kl(model, ids, "auto")
    ppl, kl, _ = perplexity_and_kl(model, ids, "int8", reference=ref)
    sim_ppl, sim_kl, _ = perplexity_and_kl(model, ids, "auto", reference=ref,
                                           attention=simulated_attention(Rounding(8)))
    assert math.isclose(sim_ppl, ppl, rel_tol=1e-9) and math.isclose(sim_kl, kl, rel_tol=1e-6)   # the same rows
    exact_ppl, exact_kl, _ = perplexity_and_kl(model, ids, "auto", reference=ref,
                                               attention=simulated_attention(Rounding(24)))
    assert exact_kl < 1e-8
    with pytest.raises(ValueError, match="model_forward"):
        from kvlearn.fast import FastLlama
        from kvlearn.runner import ModelRunner

        pool = KVPool.for_model(model.config, num_slots=len(ids))
        ModelRunner(model, pool, model_forward=FastLlama(model).forward).run([ids], [pool.alloc(len(ids))],
                                                                             every_token=True)


def test_a_per_layer_fp8_scale_is_the_layers_own_and_saturates_past_it():
    pool = KVPool(2, 1, 8, 4)
    slots = pool.alloc(4)
    for layer, size in ((0, 4.48), (1, 448.0)):
        pool.write(layer, slots, torch.full((4, 1, 8), size), -torch.full((4, 1, 8), 2 * size))
    scales = calibrated_scales(pool, slots)
    assert torch.allclose(scales, torch.tensor([[0.01, 0.02], [1.0, 2.0]]))
    layout = PerLayerScale(scales)
    k = torch.tensor([[[[0.5, -3.0, 4.48, 100.0]]]])   # [B, kv_heads, L, D]: the last value past 448 * 0.01
    rk, _ = layout(k, k, torch.tensor([0]), 0)
    assert rk[0, 0, 0, 3] == 4.48 and torch.allclose(rk[..., :3], k[..., :3], rtol=2 ** -4)
    assert torch.equal(layout(k, k, torch.tensor([0]), 1)[0], k.to(torch.float8_e4m3fn).float())   # scale 1.0
    assert layout.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 64

