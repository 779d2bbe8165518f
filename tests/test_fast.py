"""The runner's session and the engine's fast path (packed weights, grouped and cascade attention):
same attention, logits and tokens as the plain path and Hugging Face, the model untouched."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlearn.attention import ATTN_IMPLEMENTATION, AttentionMetadata, paged_attention
from kvlearn.bench.peers import SystemResult
from kvlearn.bench.report import compare_tokens
from kvlearn.fast import FastLlama, PackedLinear
from kvlearn.fast.attention import DECODE_PAD_SLOTS, PAD_RATIO, SHARED_MIN, FastStep, fast_paged_attention
from kvlearn.fast.packed import apply_rope, signed_sine
from kvlearn.model import chat_ids
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner, greedy_generate
from kvlearn.serving.engine import Engine
from kvlearn.serving.workloads import make_workload
from tests.hf_reference import hf_greedy

TOL = 1e-4
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How do bees make honey?"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def fast_runner(model):
    # room for the 16-request workload without sharing: 16 x (about 330 prompt + 32 new) tokens
    return fast_runner_for(model, num_slots=6144)


def fast_runner_for(model, num_slots):
    pool = KVPool.for_model(model.config, num_slots=num_slots, device=model.device)
    return ModelRunner(model, pool, model_forward=FastLlama(model).forward)


def hf_last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0, -1]


@pytest.mark.parametrize("one_run", [True, False])
@pytest.mark.parametrize("own", [[5, 20, 40, 3], [0, 9]])
def test_a_shared_prefix_is_read_once_with_the_same_result(own, one_run):
    """A decode step of sequences whose contexts start with the same 200 slots: the cascade (shared
    part read and scored once: a view of the pool when its slots are one run, else gathered) equals
    chapter 5's one SDPA over each sequence's whole context."""
    q_lens = [1] * len(own)
    torch.manual_seed(0)
    pool = KVPool(2, 3, 64, 1024)
    pool.kv.normal_()
    shared = pool.alloc(200)
    if not one_run:
        shared = shared.flip(0)
    slots = [torch.cat([shared, pool.alloc(n + q)]) for n, q in zip(own, q_lens, strict=True)]
    step = FastStep.build(q_lens, slots)
    group = step.groups[0]
    assert len(step.groups) == 1 and group.kind == "cascade" and group.shared_len == 200 >= SHARED_MIN
    assert isinstance(group.shared, slice) == one_run
    q, k, v = torch.randn(sum(q_lens), 9, 64), torch.randn(sum(q_lens), 3, 64), torch.randn(sum(q_lens), 3, 64)
    cascade = fast_paged_attention(q, k, v, 1, pool, step, scale=0.125)
    one_sdpa = paged_attention(q, k, v, 1, pool, AttentionMetadata.build(q_lens, slots), scale=0.125)
    assert (cascade - one_sdpa).abs().max() <= 1e-5


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float64])
def test_sequences_of_very_different_lengths_are_attended_in_groups_with_the_same_result(pool_dtype):
    """Prefills apart from decodes, and contexts more than PAD_RATIO apart in different groups, each
    padded only to its own longest (decode groups joined again where that pads little); the result
    equals chapter 5's one SDPA over the whole padded step. The fresh prompt reads its own new K/V
    when the pool keeps them as they are, else the pool."""
    torch.manual_seed(0)
    pool = KVPool(2, 3, 64, 2048, dtype=pool_dtype)
    pool.kv.normal_()
    q_lens = [60, 5, 1, 1, 1]
    slots = [pool.alloc(n) for n in (60, 25, 40, DECODE_PAD_SLOTS + 100, 9)]
    step = FastStep.build(q_lens, slots)
    groups = [(g.tokens.tolist(), g.md.kv_lens.tolist(), tuple(g.md.mask.shape[2:])) for g in step.groups]
    long = DECODE_PAD_SLOTS + 100
    assert groups == [(list(range(60)), [60], (60, 60)), (list(range(60, 65)), [25], (5, 25)),
                      ([66], [long], (1, long)), ([65, 67], [40, 9], (1, 40))]
    assert [g.kind for g in step.groups] == ["fresh", "padded", "decode", "decode"]
    similar = FastStep.build([1, 1, 1], [slots[2], slots[0], slots[4]])   # 40, 60, 9: padding 71 slots
    assert len(similar.groups) == 1 and similar.groups[0].tokens is None  # one group, the whole step
    q, k, v = torch.randn(sum(q_lens), 9, 64), torch.randn(sum(q_lens), 3, 64), torch.randn(sum(q_lens), 3, 64)
    grouped = fast_paged_attention(q, k, v, 1, pool, step, scale=0.125)
    whole = paged_attention(q, k, v, 1, pool, AttentionMetadata.build(q_lens, slots), scale=0.125)
    assert (grouped - whole).abs().max() <= 1e-5


def test_decode_groups_are_joined_below_decode_pad_slots_of_padding():
    """Two decodes whose contexts differ by more than PAD_RATIO: one group while padding the shorter
    adds fewer than DECODE_PAD_SLOTS slots, two from exactly DECODE_PAD_SLOTS on."""
    def num_groups(longer, shorter=100):
        return len(FastStep.build([1, 1], [torch.arange(longer), torch.arange(5000, 5000 + shorter)]).groups)

    assert num_groups(100 + DECODE_PAD_SLOTS - 1) == 1
    assert num_groups(100 + DECODE_PAD_SLOTS) == 2
    assert 250 > 100 * PAD_RATIO and num_groups(250) == 1   # split by PAD_RATIO, joined again


def test_the_shared_prefix_stops_at_the_first_difference_or_new_token():
    def shared_len(q_lens, slots):
        return max(group.shared_len for group in FastStep.build(q_lens, slots).groups)

    n = SHARED_MIN + 40
    a, b = torch.arange(0, n + 10), torch.cat([torch.arange(0, n), torch.arange(1000, 1010)])
    assert shared_len([1, 1], [a, b]) == n
    assert shared_len([1, 1], [a, a[:n + 5]]) == n + 4     # the shorter one's new token at n + 4
    assert shared_len([2, 1], [a, a + 0]) == 0             # a prefill in the step: one SDPA
    assert shared_len([1, 1], [a[:SHARED_MIN], a[:SHARED_MIN] + 0]) == 0   # SHARED_MIN - 1 shared: below it
    assert shared_len([1, 1], [a[:SHARED_MIN + 1], a[:SHARED_MIN + 1] + 0]) == SHARED_MIN   # exactly SHARED_MIN
    assert shared_len([1], [a]) == 0


def test_fast_prefill_and_mixed_step_match_hugging_face(model, prompts, fast_runner):
    pool = fast_runner.pool
    a, b, c = prompts
    slots = [pool.alloc(len(a)), pool.alloc(len(b))]
    try:
        logits = fast_runner.forward([a, b], slots)
        for ids, got in zip((a, b), logits, strict=True):
            assert (got - hf_last_logits(model, ids)).abs().max() <= TOL
        first = int(logits[0].argmax())
        slots[0] = torch.cat([slots[0], pool.alloc(1)])
        slots.append(pool.alloc(len(c)))
        mixed = fast_runner.forward([[first], c], [slots[0], slots[2]])  # a decodes while c prefills
        assert (mixed[0] - hf_last_logits(model, a + [first])).abs().max() <= TOL
        assert (mixed[1] - hf_last_logits(model, c)).abs().max() <= TOL
    finally:
        for s in slots:
            pool.free(s)


@pytest.mark.thorough   # HF's tokens in every cache mode: the test after this one
def test_fast_greedy_equals_hugging_face_generate_on_the_shared_system_workload(model, tokenizer, fast_runner):
    workload = make_workload("shared_system", tokenizer)
    assert workload.num_requests == 16
    eos = model.generation_config.eos_token_id
    fast = greedy_generate(fast_runner, workload.prompt_lists(), max_new_tokens=32, eos_token_id=eos)
    reference = [hf_greedy(model, p, 32) for p in workload.prompts]
    mismatches, ties = compare_tokens([SystemResult("hf", reference, 1.0), SystemResult("fast", fast, 1.0)],
                                      workload, model)
    assert mismatches == [], mismatches
    assert len(ties) <= 1, ties  # an exact float tie may go either way; more would be suspicious
    assert fast_runner.pool.num_free == fast_runner.pool.num_slots


@pytest.mark.parametrize("cache", ["radix", "blocks", "none"])
def test_fast_and_plain_engines_give_hugging_face_tokens_in_every_cache_mode(model, tokenizer, cache):
    """Served by the engine: a shared system prompt (a prompt prefilled alone, then prefills after a
    cached prefix, decodes over a shared prefix or not), the same greedy tokens on both paths as HF."""
    workload = make_workload("shared_system", tokenizer, num_requests=4)
    reference = [hf_greedy(model, p, 8) for p in workload.prompts]
    results = [SystemResult("hf", reference, 1.0)]
    for fast in (True, False):
        engine = Engine(model, tokenizer, cache=cache, num_slots=2048, fast=fast)
        results.append(SystemResult(f"fast={fast}", [o.token_ids for o in engine.generate(
            workload.prompt_lists(), max_new_tokens=8)], 1.0))
    mismatches, ties = compare_tokens(results, workload, model)
    assert mismatches == [] and ties == [], (mismatches, ties)


def test_the_model_is_left_exactly_as_found(model, prompts):
    ids = torch.tensor([prompts[0]])

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)

    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    before, impl = generate(), model.config._attn_implementation
    runner = fast_runner_for(model, num_slots=512)
    greedy_generate(runner, prompts[:2], max_new_tokens=4)
    assert all(torch.equal(p, params[name]) for name, p in model.named_parameters())
    assert model.config._attn_implementation == impl != ATTN_IMPLEMENTATION
    assert torch.equal(generate(), before)


def test_a_session_switches_the_attention_once_and_restores_it(model, prompts, monkeypatch):
    calls = []
    original = type(model).set_attn_implementation
    monkeypatch.setattr(type(model), "set_attn_implementation",
                        lambda self, name: calls.append(name) or original(self, name))
    impl = model.config._attn_implementation
    runner = ModelRunner(model, KVPool.for_model(model.config, num_slots=512, device=model.device))
    with runner.active():
        with runner.active():                           # nested: part of the outer session
            greedy_generate(runner, prompts[:2], max_new_tokens=3)
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert calls == [ATTN_IMPLEMENTATION, impl] and model.config._attn_implementation == impl
    calls.clear()
    greedy_generate(runner, prompts[:1], max_new_tokens=2)  # no session: each step switches and restores
    assert calls == [ATTN_IMPLEMENTATION, impl] * 2


def test_a_session_restores_the_attention_on_error(model):
    impl = model.config._attn_implementation
    runner = ModelRunner(model, KVPool.for_model(model.config, num_slots=64, device=model.device))
    with pytest.raises(KeyError), runner.active():
        raise KeyError("boom")
    assert model.config._attn_implementation == impl


def test_without_onednn_the_packed_weights_go_through_plain_linear(model, monkeypatch):
    weight = model.model.layers[0].mlp.down_proj.weight
    x = torch.randn(5, weight.shape[1])
    fast = PackedLinear(weight)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    plain = PackedLinear(weight)
    assert plain.kind == "linear" and plain.weight.data_ptr() != weight.data_ptr()
    assert (plain(x) - x @ weight.T).abs().max() <= TOL and (fast(x) - plain(x)).abs().max() <= TOL


def test_other_architectures_are_refused_with_a_clear_message():
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu", attention_bias=True)
    with pytest.raises(ValueError, match="Llama-like.*gelu.*bias"):
        FastLlama(LlamaForCausalLM(cfg))


def test_the_fast_rope_is_hugging_face_s_rotation_to_the_bit():
    """x * cos + roll(x) * signed_sin is Llama's x * cos + rotate_half(x) * sin: the negation moved from
    x's second half to sin's first half is exact."""
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(0)
    x, angle = torch.randn(7, 12, 64), torch.randn(7, 1, 64) * 30
    cos, sin = angle.cos(), angle.sin()
    assert torch.equal(apply_rope(x, cos, signed_sine(sin)), x * cos + rotate_half(x) * sin)
