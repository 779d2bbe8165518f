"""The `decode_kernel` part (chapter 5, issue 45): the worked stage-1 kernel passes its suite in Triton's
interpreter, kernels that break a rule fail it with that rule's hint, the engine serves a copy of it
with Hugging Face's tokens, and importing kvlearn never imports triton."""

import collections
import random
import subprocess
import sys
import time

import pytest
import torch

import kvlearn.kernels
from kvlearn import Engine, EngineConfig
from kvlearn.errors import PartError
from kvlearn.parts import PARTS, check, suite_decode_kernel
from tests.hf_reference import hf_greedy
from tests.kernel_variants import kernel_copy

triton_missing = pytest.mark.skipif(kvlearn.kernels.triton_import_error() is not None,
                                    reason="Triton has no wheels for this platform (Linux only)")


@triton_missing
@pytest.mark.thorough   # chapter 5 checks the worked kernel under nbval
def test_the_worked_kernel_passes_within_a_minute():
    start = time.perf_counter()
    report = check("decode_kernel", PARTS["decode_kernel"])
    assert report.passed, report.message
    assert report.programs == suite_decode_kernel.PROGRAMS and time.perf_counter() - start < 60


@triton_missing
@pytest.mark.parametrize("old, new, rule", [
    ("ok = pos < end", "ok = pos <= end", "past"),
    ("slot = page * PAGE_SIZE + pos % PAGE_SIZE", "slot = page * PAGE_SIZE + pos // PAGE_SIZE", "slot"),
    ("l = l * alpha + tl.sum(p, 1)\n        acc = acc * alpha[:, None] +", "l = l + tl.sum(p, 1)\n        acc = acc +",
     "rescale"),
    ("at = slot[:, None] * stride_cs + g * stride_ch", "at = slot[:, None] * stride_cs + 0 * stride_ch", "gqa"),
    ("g * stride_ch + d[None, :]", "g * GROUP * stride_ch + d[None, :]", "gqa"),   # a query head's number
    ('score = tl.where(ok[None, :], score, float("-inf"))', "score = score", "past"),   # masked lanes weigh
    ("k = tl.load(k_cache + at, mask=kv_ok, other=0.0)", "k = tl.load(k_cache + at)", "slot"),
])
@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_a_wrong_kernel_fails_with_the_rule_it_broke(tmp_path, old, new, rule):
    report = check("decode_kernel", kernel_copy(tmp_path, old, new))
    assert not report.passed
    assert f"Hint: {suite_decode_kernel.HINTS[rule]}" in report.message, report.message


def test_programs_of_seed_0_cover_the_cases_the_suite_promises():
    rng = random.Random(0)
    programs = [suite_decode_kernel.generate(rng)[0] for _ in range(suite_decode_kernel.PROGRAMS)]
    seen = collections.defaultdict(set)
    for p in programs:
        for key in ("group", "head_dim", "dtype", "page_size", "splits", "kv_heads"):
            seen[key].add(p[key])
        seen["batch"].add(len(p["lens"]))
        seen["lens"] |= set(p["lens"])
        seen["empty split"] |= {n < p["splits"] for n in p["lens"]}
        seen["tiles in a split"] |= {-(-n // p["splits"]) > 64 for n in p["lens"]}
    assert seen["group"] == {1, 3, 4} and seen["head_dim"] == {64, 80, 128} and seen["page_size"] == {1, 6, 16}
    assert seen["kv_heads"] == {1, 2, 3}
    assert len(seen["dtype"]) == 2 and seen["splits"] == {1, 2, 3} and seen["batch"] == {1, 2, 3, 4}
    assert {1, 63, 64, 65} <= seen["lens"] and seen["empty split"] == seen["tiles in a split"] == {True, False}


@pytest.mark.slow   # 3 s or more: `make quick` leaves it out
def test_importing_kvlearn_and_its_parts_never_imports_triton():
    code = ("import sys, kvlearn, kvlearn.parts, kvlearn.serving.config\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n"
            "print(kvlearn.parts.PARTS['decode_kernel'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kvlearn.kernels.decode.decode_kernel, imported when first used" in out


def test_without_triton_the_check_says_so(monkeypatch):
    monkeypatch.setattr(kvlearn.kernels, "triton_import_error", lambda: "No module named 'triton'")
    report = check("decode_kernel", PARTS["decode_kernel"])
    assert not report.passed and "cannot be checked here" in report.message and "pip install triton" in report.message


def test_the_engine_asks_for_the_triton_backend_and_a_kernel():
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        EngineConfig(parts={"decode_kernel": PARTS["decode_kernel"]})


@triton_missing
def test_a_function_is_not_a_kernel():
    def my_decode_kernel():
        pass

    with pytest.raises(TypeError, match="must be a Triton kernel"):
        EngineConfig(attention_backend="triton", parts={"decode_kernel": my_decode_kernel})


@triton_missing
@pytest.mark.thorough   # test_kernels_engine serves the package's kernel; chapter 9 the learner's
def test_a_copy_of_the_worked_kernel_serves_hf_tokens(model, tokenizer, tmp_path):
    # Short plain-text prompts (token ids), 2 new tokens: the prefill runs in the interpreter too, and
    # the second token comes from a decode step, which runs the part in every layer.
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("One, two, three,")]
    engine = Engine(model, tokenizer, cache="radix", num_slots=64, attention_backend="triton",
                    parts={"decode_kernel": kernel_copy(tmp_path)})
    assert engine.attention_backend == "triton"
    for out in engine.generate(prompts, max_new_tokens=2):
        assert out.token_ids == hf_greedy(model, out.prompt_token_ids, 2)


@triton_missing
def test_a_kernel_whose_output_is_not_finite_raises_a_part_error(tmp_path):
    from kvlearn.attention import AttentionMetadata
    from kvlearn.parts.guard import GUARDS
    from kvlearn.pool import KVPool

    broken = kernel_copy(tmp_path, "acc / tl.where(l > 0, l, 1.0)[:, None]", "acc / 0.0")
    attention = GUARDS["decode_kernel"](broken)
    device = suite_decode_kernel.DEVICE   # compiled kernels run on CUDA only, interpreted ones on the CPU
    pool = KVPool(1, 1, 16, 32, device=device)
    md = AttentionMetadata.build([1], [torch.arange(5)], device=device)   # a decode step: one new token
    query, key = torch.randn(1, 3, 16, device=device), torch.randn(1, 1, 16, device=device)
    with pytest.raises(PartError, match=r"parts\['decode_kernel'\] \(decode_kernel\).*(NaN|inf) in its output"):
        attention(query, key, key, 0, pool, md)


@triton_missing
@pytest.mark.slow
def test_chapter_9_gathers_a_saved_kernel_and_serves_it_only_with_the_triton_backend(tmp_path, capsys):
    from kvlearn.exercises.parts import gather, gather_parts, parts_for, save_part
    from tests.kernel_variants import kernel_source

    folder = tmp_path / "my_parts"
    assert "decode_kernel" not in [r.name for r in gather_parts(folder)]   # not saved: not offered
    save_part("decode_kernel", kernel_source().replace("def decode_kernel(", "def my_decode_kernel("), folder)
    parts = gather(folder)
    assert "decode_kernel  5        yours" in capsys.readouterr().out
    assert parts_for("radix", parts) == {} and list(parts_for("radix", parts, "triton")) == ["decode_kernel"]


@triton_missing
def test_a_verdict_on_nan_arithmetic_prints_no_numpy_warning(tmp_path):
    import warnings

    kernel = kernel_copy(tmp_path, "alpha = tl.exp(m - m_new)", "alpha = tl.exp(m - m)")   # inf - inf on tile 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check("decode_kernel", kernel)
    assert not report.passed and f"Hint: {suite_decode_kernel.HINTS['nan']}" in report.message
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
