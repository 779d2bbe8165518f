"""The engine served through Triton's kernels (`attention_backend="triton"`): Hugging Face's tokens,
every layer's K/V write and attention launched as kernels; and the backend option's clear refusals.
On a CPU the kernels run in Triton's interpreter (tests/conftest.py), seconds per step: short prompts."""

import os
import subprocess
import sys

import pytest

import kvlearn.kernels
from kvlearn import Engine, EngineConfig
from kvlearn.attention import paged_attention
from kvlearn.kernels import resolve_attention_backend
from tests.hf_reference import hf_greedy

triton_missing = pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None,
                                    reason="Triton has no wheels for this platform (Linux only): the triton backend "
                                           "is refused here")


class Counted:
    """A Triton kernel that counts its launches (`kernel[grid](...)`)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@triton_missing
@pytest.mark.slow
def test_the_triton_backend_serves_hf_tokens_and_launches_kernels(model, tokenizer, monkeypatch):
    from kvlearn.kernels import decode, extend, store  # triton: imported only where it exists

    kernels = {}
    for module, name in ((store, "store_kernel"), (decode, "decode_kernel"), (decode, "decode_reduce_kernel"),
                         (extend, "extend_kernel")):
        kernels[name] = Counted(getattr(module, name))
        monkeypatch.setattr(module, name, kernels[name])
    prompts = ["What is the capital of France?", "What is the capital of Spain?"]   # a shared chat prefix
    engine = Engine(model, tokenizer, cache="radix", num_slots=256, attention_backend="triton")
    assert engine.attention_backend == "triton"
    outputs = engine.generate(prompts, max_new_tokens=2)   # a prefill, then a decode step: every kernel, interpreted
    for out in outputs:
        assert out.token_ids == hf_greedy(model, out.prompt_token_ids, 2)
    assert engine.stats["cached_tokens"] > 0          # the second prompt reused the first one's prefix
    n = {name: k.launches for name, k in kernels.items()}
    layers = model.config.num_hidden_layers
    # Every layer of every step: one K/V write, then one attention (decode steps: two stages).
    assert n["store_kernel"] > 0 and n["store_kernel"] % layers == 0
    assert n["extend_kernel"] >= layers and n["decode_kernel"] >= layers
    assert n["decode_reduce_kernel"] == n["decode_kernel"]
    assert n["store_kernel"] == n["extend_kernel"] + n["decode_kernel"]
    assert engine.pool.num_free + engine.cache.total_size == engine.pool.num_slots


def test_backend_options_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match="Unknown attention_backend 'cuda': choose one of 'torch', 'triton', 'auto'"):
        EngineConfig(attention_backend="cuda")
    with pytest.raises(ValueError, match="fast=True computes attention its own way"):
        EngineConfig(attention_backend="triton", fast=True)
    assert resolve_attention_backend("auto", "cpu") == "torch"          # the interpreter is never picked by itself
    assert EngineConfig(fast=True).attention_backend == "auto"          # auto leaves the fast path its own attention


def test_auto_serves_chapter_5s_attention_on_a_cpu(model, tokenizer):
    engine = Engine(model, tokenizer, num_slots=64)
    assert engine.attention_backend == "torch"
    assert engine.runner.attention is paged_attention


def test_triton_missing_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(kvlearn.kernels, "triton_import_error", lambda: "No module named 'triton'")
    with pytest.raises(ValueError, match=r"needs the triton package.*pip install triton.*attention_backend='torch'"):
        resolve_attention_backend("triton", "cpu")
    assert resolve_attention_backend("auto", "cpu") == "torch"


def run_fresh(code: str, interpret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@triton_missing
def test_a_cpu_without_the_interpreter_is_refused_with_what_to_do():
    code = ("import torch\nif torch.cuda.is_available(): raise SystemExit(0)\n"
            "from kvlearn.kernels import resolve_attention_backend\n"
            "try:\n    resolve_attention_backend('triton', 'cpu')\nexcept ValueError as e:\n    print(e)\n")
    out = run_fresh(code, None)
    assert "TRITON_INTERPRET=1 before Python starts" in out.stdout, out.stderr
    # Set too late: the kernels were already built for a GPU when the variable arrived.
    late = code.replace("from kvlearn.kernels import resolve_attention_backend\n",
                        "import kvlearn.kernels.backend, os\nos.environ['TRITON_INTERPRET'] = '1'\n"
                        "from kvlearn.kernels import resolve_attention_backend\n")
    out = run_fresh(late, None)
    assert "were built for a GPU in this process" in out.stdout and "restart the kernel" in out.stdout, out.stderr


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
@triton_missing
def test_the_interpreter_asked_for_after_triton_was_imported_is_refused():
    """triton.language's helpers are wrapped when triton is first imported; a later TRITON_INTERPRET
    makes interpreted kernels that would call GPU-built helpers."""
    code = ("import os, triton\nos.environ['TRITON_INTERPRET'] = '1'\n"
            "from kvlearn.kernels import resolve_attention_backend\n"
            "try:\n    resolve_attention_backend('triton', 'cpu')\nexcept ValueError as e:\n    print(e)\n")
    out = run_fresh(code, None)
    assert "was set after triton was first imported" in out.stdout, out.stderr


@triton_missing
@pytest.mark.slow
def test_an_int8_pool_serves_through_the_kernels_with_the_torch_paths_tokens(model, tokenizer):
    """Chapter 10's int8 pool, quantized in the store kernel and read in extend's tile load, decode
    steps included: the tokens of chapter 5's torch attention on the same format."""
    prompts = ["What is the capital of France?"]
    torch_path = Engine(model, tokenizer, kv_cache_dtype="int8", num_slots=128).generate(prompts, max_new_tokens=2)
    engine = Engine(model, tokenizer, kv_cache_dtype="int8", num_slots=128, attention_backend="triton")
    assert engine.attention_backend == "triton"
    assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=2)] == [o.token_ids for o in torch_path]
