"""The attention part (chapter 5): a function a learner writes, judged by `check`, served by the engine.

The correct function below is written the way a learner would, outside the package: one sequence at
a time, plain matrix products, no import of kvlearn.attention. The buggy ones break one rule each.
"""

import pytest
import torch

from kvlearn.attention import paged_attention
from kvlearn.parts import PARTS, CheckReport, check
from kvlearn.pool import KVPool
from kvlearn.runner import ModelRunner
from kvlearn.serving.config import EngineConfig


def my_attention(query, key, value, layer, kv_pool, md, scale=None, *, write=True, causal=True,
                 grouped=True, own_scale=False):
    """Chapter 5 by hand; the keywords turn one rule off (the known wrong turns)."""
    if write:
        kv_pool.write(layer, md.slot_mapping, key, value)
    if scale is None or own_scale:
        scale = query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    out, start = [], 0
    for b in range(len(md.kv_lens)):
        n = int(md.kv_lens[b])
        q_len = int(md.last_token[b]) + 1 - start
        context = md.kv_indices[b, :n]
        k, v = kv_pool.k[layer][context], kv_pool.v[layer][context]          # [n, kv_heads, head_dim]
        k, v = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if grouped else \
            (k.repeat(1, group, 1), v.repeat(1, group, 1))
        scores = torch.einsum("qhd,khd->hqk", query[start:start + q_len], k) * scale
        if causal:
            sees = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)
            scores = scores.masked_fill(~sees, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(out)


def buggy(name, **rule):
    def attention(query, key, value, layer, kv_pool, md, scale=None):
        return my_attention(query, key, value, layer, kv_pool, md, scale, **rule)

    attention.__name__ = name
    return attention


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_the_package_attention_and_one_written_outside_pass():
    assert PARTS["attention"] is paged_attention
    for impl in (paged_attention, my_attention):
        report = check("attention", impl)
        assert report.passed and report.calls > 1000, report.message


BUGGY = [
    (buggy("no_write", write=False), ["kv_pool.write(layer, md.slot_mapping, key, value)", "expected", "got"]),
    (buggy("no_causal_mask", causal=False), ["sees its own position", "out[", "expected"]),
    (buggy("wrong_gqa", grouped=False), ["h // (heads // kv_heads)", "head 1"]),
    (buggy("wrong_scale", own_scale=True), ["the scale you are given", "expected"]),
]


@pytest.mark.parametrize("impl, words", BUGGY, ids=[b[0].__name__ for b in BUGGY])
def test_known_buggy_attention_fails_with_a_message(impl, words):
    report = check("attention", impl)
    assert isinstance(report, CheckReport) and not report.passed
    assert f"{impl.__name__} does not meet the attention contract (chapter 5" in report.message
    assert "md = AttentionMetadata.build(" in report.message and f"out = {impl.__name__}(" in report.message
    for word in words:
        assert word in report.message, report.message
    calls = [line for line in report.message.splitlines() if line.startswith("    out = ")]
    assert len(calls) <= 3, report.message   # shrunk to a call or two


def test_reading_before_writing_and_writing_the_wrong_layer_are_named():
    def reads_first(query, key, value, layer, kv_pool, md, scale=None):
        before = KVPool(1, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.num_slots)
        before.kv[0].copy_(kv_pool.kv[layer])
        out = my_attention(query, key, value, 0, before, md, scale, write=False)
        kv_pool.write(layer, md.slot_mapping, key, value)
        return out

    def wrong_layer(query, key, value, layer, kv_pool, md, scale=None):
        kv_pool.write(kv_pool.num_layers - 1 - layer, md.slot_mapping, key, value)
        return my_attention(query, key, value, layer, kv_pool, md, scale, write=False)

    assert "write before you read" in check("attention", reads_first).message
    report = check("attention", wrong_layer)
    assert "the call was for layer" in report.message and "write only the step's new slots" in report.message


def test_a_stub_and_a_wrong_return_say_not_yet_or_what_to_return():
    def stub(*args):
        raise NotImplementedError

    assert check("attention", stub).message.startswith("Not yet: `out = stub(")

    def no_return(query, key, value, layer, kv_pool, md, scale=None):
        kv_pool.write(layer, md.slot_mapping, key, value)

    assert "out must be a tensor of shape" in check("attention", no_return).message


@pytest.mark.parametrize("impl", [None, 3, lambda *a: 1 / 0, KVPool])
def test_check_never_raises_because_of_the_attention(impl):
    report = check("attention", impl)
    assert not report.passed and report.message


def test_the_runner_and_the_config_take_an_attention_function():
    assert EngineConfig(cache="none", parts={"attention": my_attention}).parts == {"attention": my_attention}
    with pytest.raises(TypeError, match="must be a class \\(or a function\\)"):
        EngineConfig(parts={"attention": "my_attention"})


def test_the_runner_refuses_a_bad_attention(model):
    pool = KVPool.for_model(model.config, num_slots=16)
    assert "attention=my_attention" in repr(ModelRunner(model, pool, attention=my_attention))
    with pytest.raises(TypeError, match="attention must be a function"):
        ModelRunner(model, pool, attention=3)
    with pytest.raises(ValueError, match="not both"):
        ModelRunner(model, pool, model_forward=lambda *a: None, attention=my_attention)


@pytest.mark.slow
def test_an_attention_written_outside_the_package_serves_the_real_model(model, tokenizer):
    from kvlearn import Engine
    from kvlearn.serving.workloads import make_workload

    prompts = make_workload("shared_system", tokenizer, num_requests=3).prompt_lists()
    seen = []

    def mine(*args, **kwargs):
        seen.append(args[3])
        return my_attention(*args, **kwargs)

    attn = model.config._attn_implementation
    theirs = Engine(model, tokenizer, cache="radix", num_slots=1024)
    ours = Engine(model, tokenizer, cache="radix", num_slots=1024, fast=True, parts={"attention": mine})
    assert ours.runner.model_forward is None   # the plain path, whatever `fast` says
    expected = [out.token_ids for out in theirs.generate(prompts, max_new_tokens=8)]
    assert [out.token_ids for out in ours.generate(prompts, max_new_tokens=8)] == expected
    assert sorted(set(seen)) == list(range(model.config.num_hidden_layers))   # every layer ran it
    assert ours.stats["cached_tokens"] > 0 and model.config._attn_implementation == attn
