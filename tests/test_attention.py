"""Paged attention on the real model: parity with Hugging Face, cached prefixes, packed greedy decode."""

import pytest
import torch
from transformers import AttentionInterface

from kvlearn.attention import ATTN_IMPLEMENTATION, AttentionMetadata
from kvlearn.model import chat_ids
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner, greedy_generate
from tests.hf_reference import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "What is 12 times 7?",
    "Name a famous painter and one of their works.",
    "How do bees make honey?",
    "Give me a tip for learning to cook.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


def pool_for(model, num_slots=2048, page_size=1):
    return KVPool.for_model(model.config, num_slots=num_slots, page_size=page_size, device=model.device)


def hf_logits(model, ids):
    """Plain Hugging Face forward (default attention, no cache): logits of every position."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0]


def test_metadata_by_hand():
    # Sequence 0 prefills 3 tokens into slots 10, 11, 12; sequence 1 decodes its 4th token into slot 8.
    md = AttentionMetadata.build([3, 1], [torch.tensor([10, 11, 12]), torch.tensor([5, 6, 7, 8])])
    assert md.positions.tolist() == [0, 1, 2, 3]
    assert md.slot_mapping.tolist() == [10, 11, 12, 8]
    assert md.kv_indices.tolist() == [[10, 11, 12, 0], [5, 6, 7, 8]]
    assert md.last_token.tolist() == [2, 3]
    assert md.query_index.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert md.query_slots.tolist() == [0, 1, 2, 3]
    assert md.mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert md.mask[1, 0, 0].int().tolist() == [1, 1, 1, 1]  # the decode token sees its whole context


def test_packed_prefill_matches_hugging_face(model, prompts):
    pool = pool_for(model)
    runner = ModelRunner(model, pool)
    batch = prompts[:4]
    slots = [pool.alloc(len(p)) for p in batch]
    logits = runner.forward(batch, slots)
    assert logits.shape == (4, model.config.vocab_size) and logits.dtype == torch.float32
    for ids, got in zip(batch, logits, strict=True):
        assert (got - hf_logits(model, ids)[-1]).abs().max() <= TOL


def test_pool_holds_the_same_k_and_v_as_hugging_face_cache(model, prompts):
    ids = prompts[0]
    pool = pool_for(model)
    slots = pool.alloc(len(ids)).flip(0)  # any slots will do, even in reverse order
    ModelRunner(model, pool).forward([ids], [slots])
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in (0, 29):
        hf_k, hf_v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, T, D]
        assert (pool.k[layer][slots].transpose(0, 1) - hf_k).abs().max() <= TOL
        assert (pool.v[layer][slots].transpose(0, 1) - hf_v).abs().max() <= TOL


def test_prefill_over_a_cached_prefix(model, prompts):
    """Request B reuses the K/V request A wrote for their common first k tokens."""
    a = prompts[0]
    k = 20
    b = a[:k] + prompts[1][k:]
    pool = pool_for(model)
    runner = ModelRunner(model, pool)
    a_slots = pool.alloc(len(a))
    runner.forward([a], [a_slots])
    b_slots = torch.cat([a_slots[:k], pool.alloc(len(b) - k)])
    cached = runner.forward([b[k:]], [b_slots])[0]
    full = hf_logits(model, b)[-1]
    assert (cached - full).abs().max() <= TOL
    assert a[:k] == prompts[1][:k]  # the chat template really gives them a common prefix


def test_prefill_and_decode_mixed_in_one_step(model, prompts):
    pool = pool_for(model)
    runner = ModelRunner(model, pool)
    a, b = prompts[2], prompts[3]
    a_slots = pool.alloc(len(a))
    first = int(runner.forward([a], [a_slots])[0].argmax())
    a_slots = torch.cat([a_slots, pool.alloc(1)])
    b_slots = pool.alloc(len(b))
    logits = runner.forward([[first], b], [a_slots, b_slots])  # a decodes while b prefills
    assert (logits[0] - hf_logits(model, a + [first])[-1]).abs().max() <= TOL
    assert (logits[1] - hf_logits(model, b)[-1]).abs().max() <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_packed_greedy_equals_hugging_face_generate(model, prompts, page_size):
    """16 new tokens after prompts of 35-40: a decode that runs them all fills its 16-slot page and takes the next."""
    pool = pool_for(model, num_slots=1024, page_size=page_size)
    outputs = greedy_generate(ModelRunner(model, pool), prompts, max_new_tokens=16,
                              eos_token_id=model.generation_config.eos_token_id)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(model, ids, 16)
    assert sum(len(o) == 16 for o in outputs) >= 6  # most really decode all 16 tokens
    assert pool.num_free == pool.num_slots  # slot conservation


def test_greedy_generate_gives_slots_back_when_the_pool_runs_out(model, prompts):
    pool = pool_for(model, num_slots=len(prompts[0]) + len(prompts[1]) + 4)
    with pytest.raises(Exception, match="free slots"):
        greedy_generate(ModelRunner(model, pool), prompts[:2], max_new_tokens=10)
    assert pool.num_free == pool.num_slots


def test_the_model_is_left_as_it_was(model, prompts):
    ids = torch.tensor([prompts[4]])

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)

    before, impl = generate(), model.config._attn_implementation
    pool = pool_for(model, num_slots=256)
    greedy_generate(ModelRunner(model, pool), prompts[:2], max_new_tokens=4)
    assert model.config._attn_implementation == impl != ATTN_IMPLEMENTATION
    assert torch.equal(generate(), before)


def test_attention_is_restored_when_the_forward_fails(model, prompts, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    impl = model.config._attn_implementation
    runner = ModelRunner(model, pool_for(model, num_slots=64))
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, broken)
    with pytest.raises(RuntimeError, match="boom"):
        runner.forward([prompts[0][:5]], [runner.pool.alloc(5)])
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("make_args, error", [
    (lambda s: ([[1, 2]], [s[:2], s[2:4]]), ValueError),                    # one slots entry too many
    (lambda s: ([], []), ValueError),
    (lambda s: ([[]], [s[:1]]), TypeError),                                 # no new token
    (lambda s: ([[1, 2]], [s[:1]]), ValueError),                            # fewer slots than new tokens
    (lambda s: ([[1, 49152]], [s[:2]]), ValueError),                        # token outside the vocab
    (lambda s: ([[1.0]], [s[:1]]), TypeError),
    (lambda s: ([[1]], [s[:1].float()]), TypeError),
    (lambda s: ([[1]], [torch.tensor([64])]), ValueError),                  # slot outside the pool
    (lambda s: ([[1]], [torch.tensor([40])]), ValueError),                  # slot not allocated
    (lambda s: ([[1], [2]], [s[:1], s[:1]]), ValueError),                   # two tokens, one slot
    (lambda s: ([[1], [2]], [s[:2], s[:1]]), ValueError),                   # new token onto cached KV
    (lambda s: ([1], [s[:1]]), TypeError),                                  # not a list of lists
])
def test_runner_bad_input_leaves_the_pool_unchanged(model, make_args, error):
    pool = pool_for(model, num_slots=64)
    slots = pool.alloc(8)
    runner = ModelRunner(model, pool)
    before, free = pool.kv.clone(), pool.num_free
    with pytest.raises(error):
        runner.forward(*make_args(slots))
    assert torch.equal(pool.kv, before) and pool.num_free == free


def test_runner_refuses_a_pool_of_another_shape(model):
    with pytest.raises(ValueError, match="for_model"):
        ModelRunner(model, KVPool(30, 4, 64, 8, device="cpu"))
    with pytest.raises(TypeError):
        ModelRunner(model, object())
