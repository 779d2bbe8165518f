"""Chapter 10's part, the int8 quantizer (issue 47): the package's is the "int8" format's own code and
passes its suite; wrong quantizers each fail with the rule they break named; a learner's correct one
serves SmolLM2 with the tokens of the package's int8 engine, and a wrong one at serving raises
PartError, naming the part, the call and the rule, and the engine stops."""

import pytest
import torch

from kvlearn import Engine, KVPool, PartError
from kvlearn.parts import PARTS, check
from kvlearn.parts.suite_quantizer import HINTS
from kvlearn.quant import Int8Format
from kvlearn.workshop.mutants import worked_solutions


def worked_solution() -> type:
    """The class chapter 10's `%%part quantizer` cell defines (tests/data/mutants/quantizer.py until
    the chapter has the cell)."""
    namespace: dict = {}
    exec(worked_solutions()["quantizer"], namespace)
    return namespace["MyQuantizer"]


MyQuantizer = worked_solution()


def test_the_package_part_is_the_int8_format_and_passes_like_the_worked_solution():
    pool = KVPool(1, 2, 8, 4, kv_cache_dtype="int8")
    assert PARTS["quantizer"] is Int8Format and type(pool.format) is Int8Format
    for part in (Int8Format, MyQuantizer):
        report = check("quantizer", part)
        assert report.passed and report.calls > 1000, report.message


class Truncates(MyQuantizer):
    def quantize(self, x):
        codes, scale = super().quantize(x)
        return (x.float() / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127).to(torch.int8), scale


class NoClamp(MyQuantizer):
    def quantize(self, x):
        codes, scale = super().quantize(x)
        return (x.float() / torch.where(scale > 0, scale, 1.0)).round().to(torch.int8), scale


class PerTensorScale(MyQuantizer):
    def quantize(self, x):
        scale = (x.float().abs().amax() / 127).expand(*x.shape[:-1], 1).contiguous()
        return (x.float() / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127).to(torch.int8), scale


class ScaleWithoutKeepdim(MyQuantizer):
    def quantize(self, x):
        codes, scale = super().quantize(x)
        return codes, scale[..., 0]


class ZeroRowNaN(MyQuantizer):
    """Scales the row to [-1, 1] by its absmax first: 0 / 0 on an all-zero row reaches the scale."""

    def quantize(self, x):
        absmax = x.float().abs().amax(-1, keepdim=True)
        unit = x.float() / absmax
        return (unit * 127).round().clamp(-127, 127).to(torch.int8), unit.abs().amax(-1, keepdim=True) * absmax / 127


class DividesZeroByZero(MyQuantizer):
    """The codes come out right here (int8(NaN) is 0 on this CPU): only the arithmetic shows the 0 / 0."""

    def quantize(self, x):
        scale = x.float().abs().amax(-1, keepdim=True) / 127
        return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


class DequantizesInItsDtype(MyQuantizer):
    def dequantize(self, codes, scale, dtype):
        return codes.to(dtype) * scale.to(dtype)


class KeepsFloat32(MyQuantizer):
    def dequantize(self, codes, scale, dtype):
        return codes.float() * scale


@pytest.mark.parametrize("wrong, rule", [(Truncates, "round"), (NoClamp, "clamp"), (PerTensorScale, "per_row"),
                                         (ScaleWithoutKeepdim, "scale_shape"), (ZeroRowNaN, "zero"),
                                         (KeepsFloat32, "dtype"), (DividesZeroByZero, "zero"),
                                         (DequantizesInItsDtype, "dequantize")])
def test_a_wrong_quantizer_fails_naming_its_rule(wrong, rule):
    report = check("quantizer", wrong)
    assert not report.passed
    assert report.message.splitlines()[-1] == f"Hint: {HINTS[rule]}", report.message


def test_nan_converts_to_int8_zero_here():
    """Why the check watches quantize's arithmetic for NaN: a 0 / 0 on a zero row leaves codes 0 here."""
    assert torch.full((5, 64), float("nan")).round().clamp(-127, 127).to(torch.int8).eq(0).all()


PROMPTS = ["Name three colors.", "Name three colors and three animals."]


def test_a_learner_s_quantizer_serves_the_package_s_int8_tokens(model, tokenizer):
    ours = Engine(model, tokenizer, kv_cache_dtype="int8", num_slots=256).generate(PROMPTS, max_new_tokens=6)
    engine = Engine(model, tokenizer, kv_cache_dtype="int8", num_slots=256, parts={"quantizer": MyQuantizer})
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)] == [o.token_ids for o in ours]
    assert engine.stats["cached_tokens"] > 0   # the second prompt read the first one's quantized pages


class NaNScalesOnLongSteps(MyQuantizer):
    """Right on the suite's batches (1-4 tokens), NaN scales on a step of more than 8 tokens."""

    def quantize(self, x):
        codes, scale = super().quantize(x)
        return codes, scale * float("nan") if x.shape[0] > 8 else scale


def test_a_wrong_quantizer_at_serving_raises_part_error_and_the_engine_stops(model, tokenizer):
    assert check("quantizer", NaNScalesOnLongSteps).passed
    engine = Engine(model, tokenizer, kv_cache_dtype="int8", num_slots=256, parts={"quantizer": NaNScalesOnLongSteps})
    with pytest.raises(PartError, match=r"parts\['quantizer'\] \(NaNScalesOnLongSteps\) broke its contract in "
                                        r"quantize\(rows of shape \[\d+, 3, 64\]\).*a scale is finite and >= 0"):
        engine.generate(PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="stopped when a part broke its contract"):
        engine.generate(PROMPTS[:1], max_new_tokens=2)


def test_a_quantizer_needs_the_int8_pool(model, tokenizer):
    with pytest.raises(ValueError, match="parts\\['quantizer'\\] serves kv_cache_dtype='int8', not 'auto'"):
        Engine(model, tokenizer, num_slots=256, parts={"quantizer": MyQuantizer})
    with pytest.raises(TypeError, match="lacks dequantize"):
        Engine(model, tokenizer, kv_cache_dtype="int8", parts={"quantizer": type("Half", (), {"quantize": None})})


def test_a_failure_gives_a_call_that_runs_its_case_alone():
    import re

    report = check("quantizer", Truncates, seed=3)
    call = re.search(r"\(this case alone, to try a fix: kvlearn\.parts\.check\('quantizer', Truncates, "
                     r"case=(\d+), seed=3\)\)", report.message)
    assert call, report.message
    again = check("quantizer", Truncates, seed=3, case=int(call.group(1)))
    assert not again.passed and again.message == report.message
    alone = check("quantizer", MyQuantizer, case=int(call.group(1)))
    assert alone.passed and f"random case {call.group(1)} alone, " in alone.message
