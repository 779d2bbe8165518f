"""Chapter 0's roofline helpers: the line fit recovers known costs; bytes and FLOPs match the
config worked out by hand; the tiny twin runs the same layers at almost no cost."""

import pytest
import torch

from kvlearn.decoding import (
    StepCost,
    decode_step_bytes,
    fit_step_cost,
    forward_flops,
    matmul_gflop_s,
    plain_read_gb_s,
    time_decode_step,
    tiny_twin,
    weight_bytes,
    weight_params,
)


def test_fit_recovers_known_costs():
    truth = StepCost(fixed_s=0.059, per_seq_s=0.0032)
    fit = fit_step_cost({b: truth.seconds(b) for b in (1, 4, 16)})
    assert fit.fixed_s == pytest.approx(0.059) and fit.per_seq_s == pytest.approx(0.0032)


def test_fit_averages_out_symmetric_noise():
    truth = StepCost(fixed_s=0.010, per_seq_s=0.002)
    noisy = {1: truth.seconds(1) + 1e-4, 2: truth.seconds(2) - 1e-4, 8: truth.seconds(8) - 1e-4,
             16: truth.seconds(16) + 1e-4}
    fit = fit_step_cost(noisy)
    assert fit.fixed_s == pytest.approx(0.010, abs=2e-4) and fit.per_seq_s == pytest.approx(0.002, abs=2e-5)


def test_fit_needs_two_batch_sizes():
    with pytest.raises(ValueError, match="at least two different batch sizes"):
        fit_step_cost({1: 0.06})
    with pytest.raises(ValueError, match="at least two"):
        fit_step_cost([(1, 0.06), (16, 0.1)])


def test_throughput_tends_to_one_over_the_per_sequence_cost():
    cost = StepCost(fixed_s=0.06, per_seq_s=0.003)
    assert cost.tokens_per_s(1) == pytest.approx(1 / 0.063)
    assert cost.tokens_per_s(20) == pytest.approx(0.5 / 0.003)  # half the limit where per-seq = fixed
    assert cost.tokens_per_s(10_000) < 1 / 0.003
    assert "60.0 ms per step + 3.00 ms per sequence" in repr(cost)


def test_machine_rates_are_positive_and_inputs_checked():
    assert plain_read_gb_s(1 << 20, rounds=2) > 0 and matmul_gflop_s(64, rounds=2) > 0
    with pytest.raises(ValueError, match="rounds"):
        plain_read_gb_s(1 << 20, rounds=0)


def test_bytes_and_flops_of_smollm2_by_hand(model):
    cfg = model.config
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536  # q,o; k,v; gate, up, down
    assert weight_params(cfg) == 30 * per_layer + 576 * 49152  # and the LM head
    assert weight_bytes(model) == 4 * weight_params(cfg)  # float32: every linear weight is counted once
    step = decode_step_bytes(model, 16, 72)
    assert step == (4 * weight_params(cfg), 16 * 72 * 46_080) and step.total == sum(step)
    assert decode_step_bytes(model, 1, 72).weights == step.weights  # the weights are read once per step
    assert forward_flops(cfg, 1, 72) > 2 * weight_params(cfg)      # plus attention over 72 positions
    with pytest.raises(ValueError, match="batch"):
        decode_step_bytes(model, 0, 72)


def test_tiny_twin_has_the_layers_but_not_the_bytes(model):
    twin = tiny_twin(model.config)
    assert twin.config.num_hidden_layers == model.config.num_hidden_layers
    assert (twin.config.num_attention_heads, twin.config.num_key_value_heads) == (9, 3)
    assert weight_bytes(twin) < weight_bytes(model) / 500
    assert torch.equal(next(tiny_twin(model.config).parameters()), next(twin.parameters()))  # seeded
    assert time_decode_step(twin, 2, 8, rounds=1) > 0
    with pytest.raises(ValueError, match="context"):
        time_decode_step(twin, 1, 1)
